"""The compiled kernels on an NVIDIA GPU against the jnp references (skipped elsewhere).

The suite's conftest pins JAX to the CPU, so these run only when asked for a GPU:

    JAX_PLATFORMS=cuda pytest tests/test_gpu_kernels.py     # benchmarks/gpu_bench.py runs it too

On a GPU they also check that nothing fell back: `kernels_used()` must name the kernel itself.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rmsnorm_kernel import _fwd_and_grads

from boost_jax.kernels import rmsnorm as K
from boost_jax.model import attention as A

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs an NVIDIA GPU: JAX_PLATFORMS=cuda pytest tests/test_gpu_kernels.py"
)
EPS = 1e-6


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("impl", ["pallas", "triton"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(7, 100), (129, 3200), (4, 33, 4096)])
def test_rmsnorm_kernel_runs_natively_and_matches(impl, dtype, shape):
    ks = jax.random.split(jax.random.key(shape[-1]), 4)
    x = jax.random.normal(ks[0], shape).astype(dtype)
    w = 1.0 + 0.1 * jax.random.normal(ks[1], shape[-1:])
    gy, gs = jax.random.normal(ks[2], shape), jax.random.normal(ks[3], shape[:-1])
    K.kernels_used()
    got = _fwd_and_grads(lambda x, w: K.rmsnorm(x, w, EPS, impl=impl), x, w, gy, gs)
    assert K.kernels_used()["rmsnorm"] == impl  # not "xla (... did not lower / unavailable ...)"
    ref = _fwd_and_grads(lambda x, w: K.rmsnorm_reference(x, w, EPS), x, w, gy, gs)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, a, b in zip(("y", "s", "dx", "dscale"), got, ref):
        assert _rel(a, b) <= tol, f"{name}: {_rel(a, b):.2e}"


@pytest.mark.parametrize("impl", ["pallas", "cudnn", "chunked"])
def test_attention_runs_natively_and_matches_xla(impl):
    b, t, h, kv, dh = 2, 256, 8, 2, 64
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, t, h, dh)).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, t, kv, dh)).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, kv, dh)).astype(jnp.bfloat16)
    w = jax.random.normal(ks[3], (b, t, h * dh))

    def grads(fn, *args):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)

    got = grads(lambda q, k, v: A.attend(q, k, v, impl=impl), q, k, v)
    ref = grads(lambda q, k, v: A.attend(q, k, v, impl="xla"), *(x.astype(jnp.float32) for x in (q, k, v)))
    for name, a, r in zip(("value", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert _rel(a, r) <= 3e-2, f"{name}: {_rel(a, r):.2e}"


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 5e-3), (jnp.bfloat16, 3e-2)])  # f32: TF32 either way
def test_gated_gemm_kernels_run_natively_and_match(dtype, tol):
    """kernels/gated_gemm.py compiled by Triton (not interpreted): the gate product in the down GEMM and
    σ in a group's B GEMMs, forward and every gradient, against the plain-jnp references; the program
    holds the named kernels (no fallback)."""
    from boost_jax.kernels import gated_gemm as G

    rng = np.random.default_rng()
    g, u = (jnp.asarray(rng.normal(size=(4, 300, 547)), dtype) for _ in range(2))
    w = jnp.asarray(rng.normal(size=(547, 136)) / 20, jnp.float32)
    h = jnp.asarray(rng.normal(size=(4, 300, 3, 136)), dtype)
    ws = tuple(jnp.asarray(rng.normal(size=(136, d)) / 10, jnp.float32) for d in (200, 72, 72))

    def both(fn_gate, fn_act):
        s, pull = jax.vjp(lambda g, u, w: fn_gate(g, u, w, "silu"), g, u, w)
        ys, pull2 = jax.vjp(lambda h, ws: fn_act(h, ws, "silu"), h, ws)
        return (s, *pull(s), ys, *pull2(ys))

    got = jax.jit(lambda: both(G.gated_matmul, G.act_matmuls))()
    want = jax.jit(lambda: both(G.gated_reference, G.act_reference))()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert _rel(a, b) < tol
    text = jax.jit(lambda: both(G.gated_matmul, G.act_matmuls)).lower().compile().as_text()
    names = ("gated_gemm_fwd", "gated_gemm_dx", "gated_gemm_dw", "silu_gemm_fwd", "silu_group_gemm_dx", "silu_gemm_dw")
    for name in names:  # the group's input gradient: one kernel for its three members
        assert f'name = "{name}__gemm_' in text, name


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 5e-3), (jnp.bfloat16, 3e-2)])  # f32: TF32 either way
def test_norm_gemm_kernels_run_natively_and_match(dtype, tol):
    """kernels/norm_gemm.py compiled (the Triton add's statistics, the Pallas GEMMs that normalise what
    they load, the add + norm's backward): z, h and every gradient against the plain-jnp reference; the
    program holds the named kernels (no fallback)."""
    from boost_jax.kernels import norm_gemm as N

    rng = np.random.default_rng()
    x, r = (jnp.asarray(rng.normal(size=(4, 300, 2048)), dtype) for _ in range(2))
    s = jnp.asarray(1 + 0.1 * rng.normal(size=(2048,)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(2048, 1536)) / 40, dtype)

    def run(fn):
        out, pull = jax.vjp(lambda x, r, s, w: fn(x, r, s, w, EPS), x, r, s, w)
        return (*out, *pull(out))

    got = jax.jit(lambda: run(N.add_norm_matmul))()
    want = jax.jit(lambda: run(lambda *a: N.add_norm_reference(*a, norm_impl="xla")))()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert _rel(a, b) < tol
    text = jax.jit(lambda: run(N.add_norm_matmul)).lower().compile().as_text()
    for name in ("norm_gemm_fwd", "norm_gemm_dw"):
        assert f'name = "{name}__gemm_' in text, name
