"""Every attention implementation that runs on CPU matches the `xla` reference (value and gradient):
causal, GQA, odd lengths, float32 and bfloat16, offsets (KV cache), sharded under btp and megatron."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from boost_jax.model import remat
from boost_jax.errors import ConfigError
from boost_jax.generate import generate
from boost_jax.model import attention as A
from boost_jax.model import build_model

from test_parallel import assert_close_tree, loss_and_grads, par_config, reference

# (batch, T, heads, kv heads, head dim, block): odd lengths over several blocks with a partial last
# one, GQA groups of 2 and 3, and MHA.
SHAPES = [(2, 13, 4, 2, 8, 4), (1, 37, 6, 2, 16, 8), (2, 16, 4, 4, 8, 16)]
IMPLS = {"chunked": lambda q, k, v, off, blk: A.chunked_attention(q, k, v, off, block=blk),
         "pallas": lambda q, k, v, off, blk: A.pallas_attention(q, k, v, off)}
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def _qkv(b, t, h, kv, dh, dtype, seed, s=None):
    ks = jax.random.split(jax.random.key(seed), 4)
    s = s or t
    q = jax.random.normal(ks[0], (b, t, h, dh)).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, kv, dh)).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, kv, dh)).astype(dtype)
    w = jax.random.normal(ks[3], (b, t, h, dh))  # a random functional of the output
    return q, k, v, w


def _value_and_grads(fn, q, k, v, w):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}t{}h{}kv{}d{}blk{}".format(*s))
@pytest.mark.parametrize("impl", list(IMPLS))
def test_matches_xla(impl, shape, dtype):
    b, t, h, kv, dh, blk = shape
    q, k, v, w = _qkv(b, t, h, kv, dh, dtype, seed=t)
    got = _value_and_grads(lambda q, k, v: IMPLS[impl](q, k, v, 0, blk), q, k, v, w)
    # The reference runs in float32 on the same (rounded) inputs.
    ref = _value_and_grads(lambda q, k, v: A.xla_attention(q, k, v, 0),
                           *(x.astype(jnp.float32) for x in (q, k, v)), w)
    for name, g, r in zip(("value", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert g.dtype == (jnp.float32 if name == "value" else dtype)
        assert _rel(g, r) <= TOL[dtype], f"{name}: {_rel(g, r):.2e}"


@pytest.mark.parametrize("offset,t,s", [(5, 3, 12), (0, 5, 12), (11, 1, 12), (7, 9, 16)])
def test_chunked_with_offset_matches_xla(offset, t, s):
    """KV-cache shapes: T new queries at `offset` against S cache slots (later slots hidden)."""
    q, k, v, w = _qkv(2, t, 6, 2, 8, jnp.float32, seed=offset, s=s)
    off = jnp.int32(offset)  # traced, as in a decode step
    got = _value_and_grads(lambda q, k, v: A.chunked_attention(q, k, v, off, block=4), q, k, v, w)
    ref = _value_and_grads(lambda q, k, v: A.xla_attention(q, k, v, off), q, k, v, w)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert _rel(g, r) <= 2e-5


def test_chunked_never_builds_the_score_matrix():
    """Compiled forward+backward at T = 4096: temporaries far below one [T, S] float32 matrix."""
    b, t, h, dh = 1, 4096, 2, 16
    q = jax.ShapeDtypeStruct((b, t, h, dh), jnp.float32)
    kv = jax.ShapeDtypeStruct((b, t, 1, dh), jnp.float32)

    def temp_bytes(fn):
        grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))
        return jax.jit(grad).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes

    one_score_matrix = t * t * 4
    chunked = temp_bytes(lambda q, k, v: A.chunked_attention(q, k, v, 0, block=256))
    xla = temp_bytes(lambda q, k, v: A.xla_attention(q, k, v, 0))
    assert xla >= one_score_matrix  # the reference does hold it
    assert chunked < one_score_matrix / 8, (chunked, xla)


def test_remat_policies_name_the_attention_residuals(capsys):
    q, k, v, _ = _qkv(1, 8, 2, 1, 4, jnp.float32, seed=0)
    for policy, kept in (("dots", True), ("lowrank", False)):
        f = jax.checkpoint(lambda q, k, v: jnp.sum(A.attend(q, k, v, impl="chunked") ** 2),
                           policy=remat.policy(policy))
        print_saved_residuals(f, q, k, v)
        out = capsys.readouterr().out
        assert (("named 'attn_out'" in out) and ("named 'attn_lse'" in out)) == kept, (policy, out)


def test_auto_and_fallbacks_resolve():
    q = jnp.zeros((1, 8, 2, 4))
    long_k = jnp.zeros((1, A.AUTO_XLA_MAX_KEYS + 1, 2, 4))
    assert A.resolve("auto", q, q, 0) == "xla"  # CPU, short
    assert A.resolve("auto", q, long_k, 0) == "chunked"
    assert A.resolve("pallas", q, q, jnp.int32(3)) == "chunked"  # a decode step
    with pytest.raises(ConfigError, match="model.attention"):
        A.resolve("flash", q, q, 0)


def test_cudnn_is_a_clear_error_on_cpu():
    q = jnp.zeros((1, 8, 2, 4), jnp.bfloat16)
    with pytest.raises(ConfigError, match="model.attention.*GPU"):
        A.attend(q, q, q, impl="cudnn")


@pytest.mark.parametrize("impl", ["chunked", "pallas"])
def test_cached_generation_matches_xla(make_config, monkeypatch, impl):
    monkeypatch.setattr(A, "CHUNK", 4)
    prompt = np.random.default_rng(1).integers(0, 256, (2, 6)).astype(np.int32)
    ref_model = build_model(make_config(**{"model.attention": "xla"}).model, seed=5)
    model = build_model(make_config(**{"model.attention": impl}).model, seed=5)
    out = generate(model, prompt, 6)
    np.testing.assert_array_equal(out, generate(ref_model, prompt, 6))
    full, _ = model(jnp.asarray(out))  # no cache: the implementation itself, over several blocks
    want, _ = ref_model(jnp.asarray(out))
    assert _rel(full, want) <= 2e-5


SHARDED = {"chunked_btp": ("chunked", "btp", (2, 1, 4), {}),
           "chunked_megatron": ("chunked", "megatron", (2, 1, 4), {}),
           "pallas_btp": ("pallas", "btp", (2, 1, 4), {}),
           "chunked_pipeline_dots_remat": ("chunked", "btp", (2, 1, 2),
                                           {"parallel.pipeline": 2, "model.n_layers": 4, "remat.policy": "dots"})}


@pytest.mark.parametrize("case", list(SHARDED))
def test_sharded_matches_single_device_xla(make_config, monkeypatch, case):
    """8 emulated devices, GQA, 2 chunks of 8: loss and grads as the one-device xla run."""
    impl, strategy, mesh, kw = SHARDED[case]
    monkeypatch.setattr(A, "CHUNK", 8)
    cfg = par_config(make_config, strategy, "cola", mesh, **{"model.n_kv_heads": 4, **kw})
    params, tokens, (ref_loss, ref_grads) = reference(cfg)  # model.attention=auto: xla at this length
    cfg.model.attention = impl
    loss, grads = loss_and_grads(cfg, params, tokens)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_close_tree(grads, ref_grads, 1e-5)


def test_pallas_attention_lowers_to_triton_for_cuda():
    """The compiled (not interpreted) flash kernels, forward and backward, lower for an NVIDIA GPU
    from this CPU host (GQA, bf16, head dim 64)."""
    q = jax.ShapeDtypeStruct((2, 256, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
    loss = lambda q, k, v: A.pallas_attention(q, k, v, 0, interpret=False).astype(jnp.float32).sum()  # noqa: E731
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") >= 2


def test_pallas_runs_the_public_mha_when_the_private_backward_changed(monkeypatch):
    """A jax whose private _mha_backward has another signature gets the module's public mha (its own
    custom_vjp), with a warning; value and gradients still match xla."""
    mod = A._pallas_mha_module()
    assert A._private_backward_ok(mod)  # this jax: the fused path with the remat residuals
    monkeypatch.setattr(mod, "_mha_backward", lambda sm_scale, causal, block_q, block_k, res, do: None)
    q, k, v, w = _qkv(2, 13, 4, 2, 8, jnp.float32, seed=3)
    with pytest.warns(UserWarning, match="public mha"):
        got = _value_and_grads(lambda q, k, v: A.pallas_attention(q, k, v, 0), q, k, v, w)
    ref = _value_and_grads(lambda q, k, v: A.xla_attention(q, k, v, 0), q, k, v, w)
    for name, g, r in zip(("value", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert _rel(g, r) <= TOL[jnp.float32], f"{name}: {_rel(g, r):.2e}"


def test_chunked_adds_no_collective_under_btp(make_config, monkeypatch):
    """The blockwise loops stay head-local: the compiled train step's collectives (kind, axes, count,
    elements) are those of the xla attention (data 2 x tensor 4, GQA, 4 chunks of 64)."""
    from boost_jax.tools.comm_report import compile_program
    from boost_jax.tools.hlo_comm import parse_collectives, summarize
    monkeypatch.setattr(A, "CHUNK", 64)
    found = {}
    for impl in ("xla", "chunked"):
        cfg = par_config(make_config, "btp", "cola", (2, 1, 4), **{
            "model.n_kv_heads": 4, "model.max_seq_len": 256, "train.seq_len": 256, "train.global_batch": 4,
            "model.attention": impl})
        compiled, mesh, _ = compile_program(cfg, "train_step", jax.devices()[:8], 2, False)
        found[impl] = summarize(parse_collectives(compiled.as_text(), mesh), by=("kind", "axes"))
    assert found["chunked"] == found["xla"]
