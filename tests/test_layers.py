"""Layer math against plain numpy formulas on fresh random inputs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from boost_jax.config import base_config
from boost_jax.model.attention import attend, rope
from boost_jax.model.linear import Projection, RMSNorm, project
from boost_jax.model.transformer import MLP


def small_model(kind, **fields):
    m = base_config().model
    m.update(linear=kind, **fields)
    return m


def silu(x):
    return x / (1.0 + np.exp(-x))


@pytest.mark.parametrize("kind", ["dense", "lowrank", "cola"])
def test_projection_matches_formula(kind):
    rng = np.random.default_rng(0)
    proj = Projection(small_model(kind, rank=6), 24, 40, axes=("embed", "mlp"), group="mlp_in", rngs=nnx.Rngs(params=1))
    x = rng.standard_normal((3, 5, 24)).astype(np.float32)
    got = np.asarray(project([proj], jnp.asarray(x), grouped=False)[0])
    if kind == "dense":
        want = x @ np.asarray(proj.w[...])
    else:
        h = x @ np.asarray(proj.a[...])
        want = (silu(h) if kind == "cola" else h) @ np.asarray(proj.b[...])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_cola_init_product_variance():
    d_in, d_out, r = 512, 768, 128
    proj = Projection(
        small_model("lowrank", rank=r), d_in, d_out, axes=("embed", "mlp"), group="mlp_in", rngs=nnx.Rngs(params=3)
    )
    a, b = np.asarray(proj.a[...]), np.asarray(proj.b[...])
    factor_std = r**-0.25 * (d_in + d_out) ** -0.25
    assert abs(a.std() / factor_std - 1) < 0.02 and abs(b.std() / factor_std - 1) < 0.02
    assert abs((a @ b).var() * (d_in + d_out) - 1) < 0.1


def test_rmsnorm_matches_formula():
    x = np.random.default_rng(1).standard_normal((4, 7, 33)).astype(np.float32)
    norm = RMSNorm(33, eps=1e-6)
    norm.scale[...] = jnp.asarray(np.random.default_rng(2).standard_normal(33).astype(np.float32))
    want = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * np.asarray(norm.scale[...])
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), want, rtol=1e-5, atol=1e-6)


def test_rope_matches_complex_rotation():
    b, t, h, dh = 2, 9, 3, 8
    x = np.random.default_rng(3).standard_normal((b, t, h, dh)).astype(np.float32)
    pos = np.random.default_rng(4).integers(0, 100, (b, t))
    half = dh // 2
    freqs = 10000.0 ** (-np.arange(half) / half)
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * pos[..., None, None] * freqs)
    want = np.concatenate([z.real, z.imag], axis=-1)
    np.testing.assert_allclose(np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), 10000.0)), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_gqa_attention_matches_repeated_heads(kv_heads):
    b, t, h, dh = 2, 6, 4, 8
    rng = np.random.default_rng(5)
    q = rng.standard_normal((b, t, h, dh)).astype(np.float32)
    k = rng.standard_normal((b, t, kv_heads, dh)).astype(np.float32)
    v = rng.standard_normal((b, t, kv_heads, dh)).astype(np.float32)
    got = np.asarray(attend(*map(jnp.asarray, (q, k, v)), impl="xla"))
    kr, vr = np.repeat(k, h // kv_heads, axis=2), np.repeat(v, h // kv_heads, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, kr) / np.sqrt(dh)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("bhts,bshd->bthd", p, vr).reshape(b, t, h * dh)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("only_lr_act", [False, True])
def test_mlp_forms(only_lr_act):
    from ml_collections import ConfigDict

    cfg = ConfigDict(dict(d_model=16, d_ff=24, linear="cola", rank=4, only_lr_act=only_lr_act, group_linears=True))
    mlp = MLP(cfg, rngs=nnx.Rngs(params=0), param_dtype=jnp.float32)
    norm = RMSNorm(16, eps=1e-6)
    x = np.random.default_rng(6).standard_normal((2, 3, 16)).astype(np.float32)
    ab = lambda p, z: silu(z @ np.asarray(p.a[...])) @ np.asarray(p.b[...])  # noqa: E731
    xn = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6)
    g, u = ab(mlp.gate, xn), ab(mlp.up, xn)
    want = ab(mlp.down, g * u if only_lr_act else silu(g) * u)
    np.testing.assert_allclose(np.asarray(mlp(jnp.asarray(x), norm)), want, rtol=1e-5, atol=1e-5)


def test_scanned_stack_equals_layer_by_layer(make_config):
    """The lax.scan over stacked blocks computes the same as applying each block in turn."""
    from boost_jax.model import build_model

    cfg = make_config()
    model = build_model(cfg.model, seed=0)
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, 256, (2, 12)))
    logits, _ = model(tokens)
    graphdef, state = nnx.split(model.layers)
    x = model.embed[...][tokens]
    pos = jnp.broadcast_to(jnp.arange(12)[None], (2, 12))
    for i in range(cfg.model.n_layers):
        block = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
        x, _ = block(x, pos)
    want = model.final_norm(x) @ model.lm_head[...]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_online_norm_reduces_partials_in_the_compute_dtype():
    """BTP's online RMSNorm (x split along d over 4 devices): value and gradients match the float64
    formula (γ ⊙ x / rms(x))·A, and the reduction of the r-wide partials (the A all-reduce) is in bf16
    under bf16 compute, not widened to float32 (which would double its bytes)."""
    from jax.sharding import AxisType

    from boost_jax.parallel import rules
    from boost_jax.parallel.online_norm import online_norm_matmul
    from boost_jax.parallel.strategies import BTP

    mesh = jax.make_mesh((1, 1, 4), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    strategy = rules.Strategy("btp", BTP, online_norm=True)
    rng = np.random.default_rng(7)
    x, scale, a = (rng.standard_normal(s) for s in ((2, 5, 32), (32,), (3, 32, 8)))
    eps = 1e-6

    def f(x, scale, a):
        with rules.use_rules(mesh, strategy):
            return online_norm_matmul(x, scale, a, eps=eps, mesh=mesh)

    def ref(x, scale, a):
        xn = scale * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
        return np.einsum("btd,gdr->btgr", xn, a)

    w = rng.standard_normal((2, 5, 3, 8))  # a random cotangent, so every output element counts
    args32 = [jnp.asarray(v, jnp.float32) for v in (x, scale, a)]
    np.testing.assert_allclose(np.asarray(f(*args32)), ref(x, scale, a), rtol=2e-4, atol=2e-4)
    loss = lambda *v: jnp.sum(f(*v).astype(jnp.float32) * w)  # noqa: E731
    gx, ga = jax.grad(loss, argnums=(0, 2))(*args32)
    h = 1e-6  # central differences of the float64 formula along random directions
    for got, i in ((gx, 0), (ga, 2)):
        d = rng.standard_normal(got.shape)
        plus, minus = [list((x, scale, a)) for _ in range(2)]
        plus[i], minus[i] = plus[i] + h * d, minus[i] - h * d
        want = (np.sum(ref(*plus) * w) - np.sum(ref(*minus) * w)) / (2 * h)
        np.testing.assert_allclose(float(jnp.sum(got * d)), want, rtol=1e-3)
    bf16 = [jnp.asarray(x, jnp.bfloat16), args32[1], args32[2]]
    np.testing.assert_allclose(np.asarray(f(*bf16), np.float32), ref(x, scale, a), rtol=0.05, atol=0.1)
    text = jax.jit(f).lower(*bf16).as_text()
    partial_sums = [ln for ln in text.splitlines() if "stablehlo.reduce" in ln and "tensor<4x2x5x3x8x" in ln]
    assert partial_sums and all("xbf16>" in ln.split("->")[-1] for ln in partial_sums), partial_sums


def test_online_norm_stores_the_residual_stream_in_its_dtype(make_config):
    """BTP's online-norm groups store each residual sum through an optimization barrier (so XLA keeps
    the bf16 stream and its gradient in bf16 between kernels): the value and gradient are the
    identity's (against the float64 formula), and the unrolled stack's train step holds barriers on the
    stream (a layer's two adds, forward and transposed); a scanned stack, BTP's sync norm and Megatron none."""
    from boost_jax.parallel.placement import GROUPED, OnlineNorm
    from boost_jax.runtime.build import build
    from boost_jax.runtime.state import trainable, with_frozen
    from boost_jax.runtime.step import next_token_loss

    mesh = jax.make_mesh((1, 1, 4), ("data", "fsdp", "tensor"))
    rng = np.random.default_rng(11)
    x, w = rng.standard_normal((2, 2, 5, 32))
    for route in (OnlineNorm(mesh, "float32"), GROUPED):
        f = lambda v: jnp.sum(jnp.asarray(w, jnp.float32) * route.stream(v) ** 2)  # noqa: E731
        got = jax.grad(f)(jnp.asarray(x, jnp.float32))
        np.testing.assert_allclose(np.asarray(got), 2 * w * x, rtol=1e-6, atol=1e-6)

    def stream_barriers(strategy, online, unroll=True):
        d = 64
        cfg = make_config(
            **{
                "model.d_model": d,
                "model.n_heads": 8,
                "model.n_kv_heads": 8,
                "model.d_ff": 128,
                "model.rank": 16,
                "model.linear": "cola",
                "parallel.strategy": strategy,
                "parallel.online_norm": online,
                "model.scan_unroll": unroll,
                "parallel.tensor": 4,
                "parallel.num_devices": 4,
            }
        )
        built = build(cfg)
        spec = built.spec
        params = built.init_state()["params"]
        tokens = jnp.zeros((cfg.train.global_batch // cfg.train.grad_accum, cfg.train.seq_len + 1), jnp.int32)
        loss = jax.value_and_grad(lambda t, p, b: next_token_loss(spec.graphdef, with_frozen(t, p), b))
        text = jax.jit(built.bind(loss)).lower(trainable(params), params, tokens).as_text()
        # a barrier on one [B, T, d] value (the others in the program pair a GEMM's operands)
        one = re.compile(rf"= stablehlo.optimization_barrier %[\w#]+ : tensor<\d+x\d+x{d}x")
        return sum(bool(one.search(line)) for line in text.splitlines())

    count = stream_barriers("btp", True)  # a layer body lowered once serves every call of it
    assert count and count % 4 == 0, count
    # none where XLA:GPU cannot schedule them (a scanned stack), nor without online norm
    assert stream_barriers("btp", True, unroll=False) == stream_barriers("btp", False) == 0
    assert stream_barriers("megatron", True) == 0
