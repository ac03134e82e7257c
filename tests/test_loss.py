"""The chunked, vocab-parallel cross-entropy equals the plain full-logits loss (value and gradient),
never holds float32 [B, T, V] logits, and evaluation in micro-batches gives the one-batch loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params
from test_parallel import assert_close_tree, loss_and_grads, par_config, reference

from boost_jax.model import build_model
from boost_jax.model.loss import head_loss
from boost_jax.runtime.step import make_eval_step


def plain_loss(h, w, labels, z_loss):
    """Full float32 logits, jax.nn.log_softmax: the independent reference."""
    logits = jnp.einsum("btd,dv->btv", h.astype(jnp.float32), w.astype(h.dtype).astype(jnp.float32))
    lse = jax.nn.logsumexp(logits, axis=-1)
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), labels[..., None], -1)[..., 0]
    return jnp.mean(ce + z_loss * lse**2)


@pytest.mark.parametrize("groups", [1, 3], ids=["rows", "row_groups3"])  # 3: a pipeline's micro-batches
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("chunk,z_loss", [(4, 0.0), (5, 1e-2), (0, 1e-2), (64, 0.0)])
def test_chunked_loss_matches_full_logits(chunk, z_loss, dtype, groups):
    b, t, d, v = 6, 13, 16, 50
    ks = jax.random.split(jax.random.key(chunk + groups), 3)
    h = jax.random.normal(ks[0], (b, t, d)).astype(dtype)
    w = 0.3 * jax.random.normal(ks[1], (d, v))
    labels = jax.random.randint(ks[2], (b, t), 0, v)
    got = jax.jit(
        jax.value_and_grad(
            lambda h, w: head_loss(h, w, labels, chunk=chunk, z_loss=z_loss, row_groups=groups), argnums=(0, 1)
        )
    )(h, w)
    want = jax.value_and_grad(lambda h, w: plain_loss(h, w, labels, z_loss), argnums=(0, 1))(h, w)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == r.dtype
        np.testing.assert_allclose(
            np.asarray(g, np.float32),
            np.asarray(r, np.float32),
            rtol=tol,
            atol=tol * float(np.abs(np.asarray(r, np.float32)).max()),
        )


@pytest.mark.parametrize("chunk,masked", [(4, False), (0, True)])
def test_low_logits_round_only_the_logits(chunk, masked):
    """low_logits (model.logits_dtype=compute): the head GEMM writes bf16 logits, nothing else changes.
    Against float64 numpy from the same bf16-rounded logits: value and gradients to float32 rounding,
    and the head writes a bf16 logits block (the float32 path a float32 one)."""
    b, t, d, v = 4, 9, 16, 50
    ks = jax.random.split(jax.random.key(11 + chunk), 4)
    h = jax.random.normal(ks[0], (b, t, d)).astype(jnp.bfloat16)
    w = 0.3 * jax.random.normal(ks[1], (d, v))
    labels = jax.random.randint(ks[2], (b, t), 0, v)
    mask = jax.random.bernoulli(ks[3], 0.7, (b, t)) if masked else None
    fn = lambda h, w: head_loss(h, w, labels, chunk=chunk, mask=mask, low_logits=True)  # noqa: E731
    loss, (dh, dw) = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(h, w)
    # float64 from the rounded logits: softmax - onehot is the logits' gradient; the head's backward
    # GEMMs take it in bf16 (as the float32 path's do), so compare those against it rounded alike
    hn, wn = np.asarray(h, np.float64), np.asarray(w.astype(jnp.bfloat16), np.float64)
    logits = np.asarray(jnp.asarray(np.einsum("btd,dv->btv", hn, wn), jnp.float32).astype(jnp.bfloat16), np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ce = lse - np.take_along_axis(logits, np.asarray(labels)[..., None], -1)[..., 0]
    weight = np.ones((b, t)) if mask is None else np.asarray(mask, np.float64)
    scale = 1.0 if masked else 1.0 / (b * t)
    np.testing.assert_allclose(float(loss), scale * (ce * weight).sum(), rtol=1e-5)
    g = (np.exp(logits - lse[..., None]) - np.eye(v)[np.asarray(labels)]) * (scale * weight)[..., None]
    g = np.asarray(jnp.asarray(g, jnp.float32).astype(jnp.bfloat16), np.float64)
    for got, want in ((dh, np.einsum("btv,dv->btd", g, wn)), (dw, np.einsum("btd,btv->dv", hn, g))):
        got = np.asarray(got, np.float64)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-2 * np.abs(want).max())
    block = f"tensor<{b}x{min(chunk or t, t)}x{v}x"  # the logits (one chunk's)
    assert f"{block}bf16>" in jax.jit(fn).lower(h, w).as_text()
    wide = lambda h, w: head_loss(h, w, labels, chunk=chunk, mask=mask)  # noqa: E731
    assert f"{block}f32>" in jax.jit(wide).lower(h, w).as_text()  # model.logits_dtype=float32


@pytest.mark.parametrize("chunk,groups", [(4, 2), (0, 3), (64, 6)])
def test_masked_loss_in_row_groups_is_the_sum_over_counted_targets(chunk, groups):
    b, t, d, v = 6, 11, 8, 40
    ks = jax.random.split(jax.random.key(7 * groups + chunk), 4)
    h, w = jax.random.normal(ks[0], (b, t, d)), 0.3 * jax.random.normal(ks[1], (d, v))
    labels, mask = jax.random.randint(ks[2], (b, t), 0, v), jax.random.bernoulli(ks[3], 0.6, (b, t))
    got = jax.jit(jax.value_and_grad(lambda h: head_loss(h, w, labels, chunk=chunk, mask=mask, row_groups=groups)))(h)

    def want(h):  # the plain full-logits loss per token, summed where counted
        logits = jnp.einsum("btd,dv->btv", h, w)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), labels[..., None], -1)[..., 0]
        return jnp.sum(jnp.where(mask, ce, 0.0))

    ref = jax.value_and_grad(want)(h)
    np.testing.assert_allclose(float(got[0]), float(ref[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ref[1]), rtol=1e-5, atol=1e-6)


def _f32_logit_buffers(chunk):
    b, t, d, v = 2, 512, 32, 4096
    h = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)
    labels = jax.ShapeDtypeStruct((b, t), jnp.int32)
    grad = jax.grad(lambda h, w, l: head_loss(h, w, l, chunk=chunk), argnums=(0, 1))
    compiled = jax.jit(grad).lower(h, w, labels).compile()
    return compiled.as_text().count(f"f32[{b},{t},{v}]"), compiled.memory_analysis().temp_size_in_bytes, b * t * v * 4


def test_no_float32_full_logits_in_the_compiled_step():
    full_count, full_temp, one_buffer = _f32_logit_buffers(0)
    assert full_count > 0 and full_temp >= one_buffer  # the plain loss does hold them
    chunked_count, chunked_temp, _ = _f32_logit_buffers(64)
    assert chunked_count == 0
    assert chunked_temp < one_buffer / 2, (chunked_temp, one_buffer)  # a few [B, 64, V] blocks


def _casts_of(jaxpr, shape, inside=False):
    """(casts of a float32 array of `shape` to bfloat16 outside any scan, inside one) in a jaxpr."""
    out, within = 0, 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type":
            a = eqn.invars[0].aval
            if a.shape == shape and a.dtype == jnp.float32 and eqn.outvars[0].aval.dtype == jnp.bfloat16:
                within, out = (within + 1, out) if inside else (within, out + 1)
        for sub in jaxprs_in_params(eqn.params):
            o, w = _casts_of(sub, shape, inside or eqn.primitive.name == "scan")
            out, within = out + o, within + w
    return out, within


def test_the_chunk_loop_casts_the_head_weight_once():
    """Under bf16 compute the head weight is cast to bf16 before the chunk loop, not in every chunk
    (forward and backward), and its gradient still comes back in float32."""
    h = jax.random.normal(jax.random.key(1), (2, 12, 8)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (8, 40))
    labels = jax.random.randint(jax.random.key(3), (2, 12), 0, 40)
    grad = jax.grad(lambda h, w: head_loss(h, w, labels, chunk=4, low_logits=True), argnums=(0, 1))
    outside, inside = _casts_of(jax.make_jaxpr(grad)(h, w).jaxpr, w.shape)
    assert outside >= 1 and inside == 0, (outside, inside)
    assert grad(h, w)[1].dtype == jnp.float32


def test_sharded_chunked_loss_matches_single_device_plain(make_config):
    """btp on data 2 x tensor 4 (vocab-parallel head), chunks of 5 positions (T = 16), z-loss on."""
    cfg = par_config(make_config, "btp", "cola", (2, 1, 4), **{"model.loss_chunk": 0, "model.z_loss": 1e-3})
    params, tokens, (ref_loss, ref_grads) = reference(cfg)
    cfg.model.loss_chunk = 5
    loss, grads = loss_and_grads(cfg, params, tokens)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_close_tree(grads, ref_grads, 1e-5)


def test_eval_in_microbatches_matches_one_batch(make_config):
    cfg = make_config(**{"model.z_loss": 0.1})
    model = build_model(cfg.model, seed=1)
    graphdef, params = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 17)), jnp.int32)
    one = jax.jit(make_eval_step(graphdef, 1))(params, tokens)
    four = jax.jit(make_eval_step(graphdef, 4))(params, tokens)
    logits, _ = model(tokens[:, :-1])  # eval reports the cross-entropy alone, without the z-loss
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[:, 1:, None], -1).mean()
    np.testing.assert_allclose([float(one), float(four)], [float(ce)] * 2, rtol=1e-5)
