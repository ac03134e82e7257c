"""The residual add and RMSNorm read into the first-stage GEMM (boost_jax/kernels/norm_gemm.py): the
Pallas kernels under the interpreter against float64 numpy, forward and every gradient, on fresh random
inputs; under nested vmap; the model with it against the model without; the sm_90 compile on this
CPU host, each kernel named for the step-time table. The Triton add's statistics-only forward runs
under Triton's interpreter in tests/test_residual_norm.py."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.kernels.norm_gemm import add_norm_matmul, add_norm_reference

EPS = 1e-5


def _np_add_norm_matmul(x, r, s, w, dz, dh, eps):
    """float64: (z, h, dx (= dr), dscale, dw) of z = (h·rsqrt(mean h² + eps)·s) @ w, h = x + r."""
    x, r, s, w, dz, dh = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, r, s, w, dz, dh))
    h = x + r
    inv = 1 / np.sqrt((h * h).mean(-1, keepdims=True) + eps)
    n = h * inv
    y = n * s
    dy = dz @ w.T
    dn = dy * s
    dx = inv * (dn - n * (dn * n).mean(-1, keepdims=True)) + dh
    rows = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
    return y @ w, h, dx, (dy * n).reshape(-1, s.size).sum(0), rows(y).T @ rows(dz)


def _close(got, want, tol):
    got, want = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()))


def _inputs(rng, lead, d, n, dtype):
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    x, r, dh = (normal(*lead, d).astype(dtype) for _ in range(3))
    s = 1 + 0.2 * normal(d)
    return x, r, s, normal(d, n) / 5, normal(*lead, n).astype(dtype), dh


@pytest.mark.parametrize(
    "lead,d,n,dtype,tol",
    [((3, 13), 56, 24, jnp.float32, 1e-5), ((40,), 33, 17, jnp.float32, 1e-5), ((2, 20), 80, 48, jnp.bfloat16, 3e-2)],
    ids=["f32", "odd", "bf16"],
)
def test_add_norm_matmul_matches_float64(lead, d, n, dtype, tol):
    """z, h, dx, dresidual, dscale and dw on shapes that fill no tile (each last tile overlaps the one
    before it), fresh random inputs; the kernels run (their names are in the jaxpr)."""
    x, r, s, w, dz, dh = _inputs(np.random.default_rng(), lead, d, n, dtype)
    fn = lambda x, r, s, w: add_norm_matmul(x, r, s, w, EPS, interpret=True)  # noqa: E731
    assert "norm_gemm_fwd" in str(jax.make_jaxpr(fn)(x, r, s, w))
    (z, h), pull = jax.vjp(fn, x, r, s, w)
    dx, dr, ds, dw = pull((dz, dh))
    want = _np_add_norm_matmul(x, r, s, w, dz, dh, EPS)
    for got, ref in zip((z, h, dx, ds, dw), want):
        _close(got, ref, tol)
    _close(dr, want[2], tol)
    assert dw.dtype == w.dtype and z.dtype == h.dtype == x.dtype


def test_add_norm_matmul_under_nested_vmap():
    """The data-parallel island's vmap and a pipeline's (nested): w and the scale shared (more rows), and
    batched (one call per element); the loss and every gradient equal the plain-jnp reference's."""
    rng = np.random.default_rng()
    x, r, s, w, _, _ = _inputs(rng, (2, 2, 3, 16), 24, 16, jnp.float32)
    probe = jnp.asarray(rng.normal(size=(2, 2, 3, 16, 16)), jnp.float32)

    def run(fn, axis, s, w):
        def loss(x, r, s, w, p):
            z, h = fn(x, r, s, w)
            return (z * p).sum() + (h * h).sum()

        grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
        inner = jax.vmap(grads, (0, 0, axis, axis, 0))
        return jax.jit(jax.vmap(inner, (0, 0, axis, axis, 0)))(x, r, s, w, probe)

    for axis in (None, 0):
        ss, ww = (s, w) if axis is None else (jnp.stack([jnp.stack([a] * 2)] * 2) for a in (s, w))
        got = run(lambda *a: add_norm_matmul(*a, EPS, interpret=True), axis, ss, ww)
        want = run(lambda *a: add_norm_reference(*a, EPS), axis, ss, ww)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            _close(a, b, 1e-5)


def test_add_norm_matmul_refuses_bad_input_and_falls_back_on_small_sides():
    x = jnp.ones((4, 32))
    with pytest.raises(ValueError, match="residual"):
        add_norm_matmul(x, jnp.ones((4, 31)), jnp.ones(32), jnp.ones((32, 16)), EPS)
    with pytest.raises(ValueError, match="impl"):
        add_norm_matmul(x, x, jnp.ones(32), jnp.ones((32, 16)), EPS, impl="cuda")
    jaxpr = str(jax.make_jaxpr(lambda x: add_norm_matmul(x, x, jnp.ones(32), jnp.ones((32, 16)), EPS))(x))
    assert "norm_gemm" not in jaxpr  # 4 rows: under a tile's 16, the reference runs


def test_the_model_with_the_norm_in_its_gemm_equals_the_model_without(make_config):
    """A cola model with the fused add + norm whose q/k/v and gate/up first stages read the add and
    the norm (model.bottleneck_kernel=norm; interpreted) computes the logits and gradients of the same
    model with the norm apart (rope)."""
    from flax import nnx

    from boost_jax.model import build_model

    heads = {"model.d_model": 64, "model.n_heads": 2, "model.n_kv_heads": 2}
    cfg = make_config(
        **{"model.n_layers": 2, "model.rank": 16, "model.group_linears": "first", "model.gate_kernel": "gemm", **heads}
    )
    tokens = jnp.asarray(np.random.default_rng().integers(0, 256, (2, 12)))
    probe = jax.random.normal(jax.random.key(9), (2, 12, cfg.model.vocab_size))
    runs = {}
    for choice in ("norm", "rope"):
        cfg.model.bottleneck_kernel = choice
        model = build_model(cfg.model, seed=3, norm_impl="triton", residual_norm="fused")  # the fused add + norm
        graphdef, state = nnx.split(model)

        def loss(state, graphdef=graphdef):
            logits, _ = nnx.merge(graphdef, state)(tokens)
            return (logits * probe).sum(), logits

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the Triton norm's loud fallback on this CPU host
            assert ("norm_gemm_fwd" in str(jax.make_jaxpr(loss)(state))) == (choice == "norm")
            runs[choice] = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    (_, got), got_grads = runs["norm"]
    (_, want), want_grads = runs["rope"]
    _close(got, want, 1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        _close(a, b, 1e-4)


def test_norm_gemm_kernels_compile_for_h100_without_a_gpu():
    """The two Pallas kernels and the Triton add's statistics-only forward lower for a deviceless H100
    (bf16, sides that are no multiple of a tile); each Pallas call's name carries its GEMM, which the
    step-time table prices as that GEMM; the add and the norm's backward are norm kernels."""
    from jax.sharding import SingleDeviceSharding

    from boost_jax.kernels import platform
    from boost_jax.tools import aot
    from boost_jax.tools.step_profile.kernels import kernels

    pytest.importorskip("jax_triton", reason="the add + norm's Triton kernels need jax-triton")
    dev = aot.devices("h100", 1)[0]
    sd = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=SingleDeviceSharding(dev))  # noqa: E731
    m, d, n = 300, 136, 72

    def step(x, r, s, w, dz, dh):
        out, pull = jax.vjp(lambda x, r, s, w: add_norm_matmul(x, r, s, w, EPS), x, r, s, w)
        return out, pull((dz, dh))

    with platform.target([dev]):
        args = sd(3, 100, d), sd(3, 100, d), sd(d, dt=jnp.float32), sd(d, n), sd(3, 100, n), sd(3, 100, d)
        text = jax.jit(step).lower(*args).compile().as_text()
    ks = kernels(text)
    gemms = {k.backend.split()[-1]: (k.gemm[:4], k.flops) for k in ks if k.kind == "gemm" and "norm_gemm" in k.backend}
    assert gemms == {
        f"norm_gemm_fwd__gemm_1x{m}x{n}x{d}": ((1, m, n, d), 2.0 * m * n * d),
        f"norm_gemm_dw__gemm_1x{d}x{n}x{m}": ((1, d, n, m), 2.0 * d * n * m),
    }, gemms
    assert sum(k.category == "norm" for k in ks) >= 2  # the add's statistics and the norm's backward
