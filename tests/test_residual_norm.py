"""The residual add fused with the RMSNorm that reads it: kernels/rmsnorm.py `add_rmsnorm` (its jnp
reference), the Triton kernels (kernels/rmsnorm_triton.py, run by Triton's CPU interpreter), their vmap
rules (kernels/row_batching.py, with a numpy stand-in that refuses vmap as a jax-triton call does)
and the blocks that defer their adds into the next norm (model/transformer.py), each against a float64
numpy reference or the separate adds on fresh random inputs."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.kernels import rmsnorm as K
from boost_jax.kernels import row_batching

EPS = 1e-6


def _np_add_norm(x, r, w, dy, dh, eps):
    """float64: (y, h, dx (= dr), dscale) of y = rmsnorm(x + r)·w against cotangents (dy, dh)."""
    x, r, w, dy, dh = (np.asarray(a, np.float64) for a in (x, r, w, dy, dh))
    h = x + r
    d = h.shape[-1]
    inv = 1 / np.sqrt((h * h).sum(-1, keepdims=True) / d + eps)
    y = h * inv * w
    dx = dy * w * inv - h * (dy * w * h).sum(-1, keepdims=True) * inv**3 / d + dh
    return y, h, dx, (dy * h * inv).reshape(-1, d).sum(0)


def _inputs(shape, dtype, seed):
    k = jax.random.split(jax.random.key(seed), 5)
    x, r = (jax.random.normal(k[i], shape, jnp.float32).astype(dtype) for i in (0, 1))
    w = 1.0 + 0.1 * jax.random.normal(k[2], shape[-1:], jnp.float32)
    dy, dh = (jax.random.normal(k[i], shape, jnp.float32).astype(dtype) for i in (3, 4))
    return x, r, w, dy, dh


def _close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(np.abs(want).max()))


def _f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


@pytest.mark.parametrize("impl", ["xla", "pallas", "triton"])
def test_add_rmsnorm_matches_float64(impl):
    """Every impl (on CPU: XLA, the Pallas interpreter after XLA's add, the Triton impl's loud XLA
    fallback) returns (RMSNorm(x + r), x + r) and their gradients as float64 numpy computes them."""
    x, r, w, dy, dh = _inputs((3, 5, 40), jnp.float32, seed=11)
    K.kernels_used()  # clear
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the triton impl's fallback warning (tested for rmsnorm itself)
        (y, h), vjp = jax.vjp(lambda x, r, w: K.add_rmsnorm(x, r, w, EPS, impl=impl), x, r, w)
        dx, dr, dw = vjp((dy, dh))
    want = _np_add_norm(x, r, w, dy, dh, EPS)
    for a, b in zip((y, h, dx, dw), want):
        _close(a, b, 1e-5)
    _close(dr, want[2], 1e-5)
    if impl == "triton":
        assert K.kernels_used()["rmsnorm"].startswith("xla (triton unavailable: ")


def test_triton_add_kernels_interpreted_match_float64(tmp_path):
    """The fused add + norm's Triton kernels under Triton's CPU interpreter (a subprocess:
    TRITON_INTERPRET=1 must precede the import of triton): partial last blocks, widths that are not
    powers of two, eps = 0, bfloat16, and 13 rows in blocks of 2 on 3 backward programs."""
    pytest.importorskip("triton", reason="needs triton (pip install triton; on GPUs the `gpu` extra)")
    cases = [
        ((7, 100), jnp.float32, 2, EPS, 0),
        ((13, 130), jnp.float32, 4, 0.0, 0),
        ((13, 20), jnp.float32, 2, EPS, 3),
        ((5, 48), jnp.bfloat16, 2, EPS, 0),
    ]
    arrays, inputs = {}, []
    as_np = lambda a: np.asarray(a.view(jnp.uint16) if a.dtype == jnp.bfloat16 else a)  # noqa: E731
    for i, (shape, dtype, rows, eps, programs) in enumerate(cases):
        x, r, w, dy, dh = _inputs(shape, dtype, seed=40 + i)
        inputs.append((x, r, w, dy, dh))
        arrays.update({f"{k}{i}": as_np(v) for k, v in dict(x=x, r=r, dy=dy, dh=dh).items()})
        arrays.update(
            {
                f"w{i}": np.asarray(w),
                f"ds{i}": np.zeros(shape[0], np.float32),
                f"eps{i}": eps,
                f"rows{i}": rows,
                f"programs{i}": programs,
                f"x{i}_dtype": jnp.dtype(dtype).name,
            }
        )
    np.savez(tmp_path / "cases.npz", **arrays)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    script = str(root / "tests" / "triton_interpreted.py")
    run = subprocess.run(
        [sys.executable, script, str(tmp_path / "cases.npz"), str(tmp_path / "out.npz")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = np.load(tmp_path / "out.npz")
    for i, ((_, dtype, _, eps, _), (x, r, w, dy, dh)) in enumerate(zip(cases, inputs)):
        got = [out[f"add_{k}{i}"] for k in ("y", "h", "dx", "dw")]
        if dtype == jnp.bfloat16:
            got[:3] = [_f32(jnp.asarray(a).view(jnp.bfloat16)) for a in got[:3]]
        want = _np_add_norm(_f32(x), _f32(r), w, _f32(dy), _f32(dh), eps)
        tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
        for a, b in zip(got, want):
            _close(a, b, tol)
        h = np.asarray(got[1], np.float64)  # the statistics-only forward (kernels/norm_gemm.py): 1/rms of h
        _close(out[f"add_inv{i}"], 1 / np.sqrt((h * h).mean(-1) + eps), 1e-5)


def test_triton_add_kernels_compile_for_h100_without_a_gpu():
    """The fused kernels (and the statistics-only forward) compile to PTX and a cubin for sm_90 on this
    CPU host; rows are 128-bit loads."""
    pytest.importorskip("triton", reason="needs triton (pip install triton; on GPUs the `gpu` extra)")
    from boost_jax.kernels import rmsnorm_triton as T

    kernels = T.compile_for_cuda(jnp.bfloat16, jnp.float32, n_rows=64, d=2048)
    for name in ("add_fwd", "add_rms", "add_bwd"):
        ptx = kernels[name].asm["ptx"]
        assert ".target sm_90" in ptx and len(kernels[name].asm["cubin"]) > 1000, name
        assert "ld.global.v4.b32" in ptx, name


# ------------------------------------------------------------------ vmap: a stand-in that refuses it


def _np_fwd(x, r, w):
    y, h, _, _ = _np_add_norm(x, r, w, x, x, EPS)
    return y.astype(np.float32), h.astype(np.float32)


def _np_bwd(h, w, dy, dh):
    y, _, dx, dw = _np_add_norm(h, np.zeros_like(h), w, dy, dh, EPS)
    return dx.astype(np.float32), dw.astype(np.float32)


def _unbatchable(fn, *shapes):
    return lambda *args: jax.pure_callback(fn, [jax.ShapeDtypeStruct(s(*args), jnp.float32) for s in shapes], *args)


_FWD = row_batching.forward(_unbatchable(_np_fwd, lambda x, *_: x.shape, lambda x, *_: x.shape))
_BWD = row_batching.backward(_unbatchable(_np_bwd, lambda h, *_: h.shape, lambda h, w, *_: w.shape))


@jax.custom_vjp
def _stand_in(x2, r2, w):
    return _FWD(x2, r2, w)


def _stand_in_fwd(x2, r2, w):
    y, h = _FWD(x2, r2, w)
    return (y, h), (h, w)


def _stand_in_bwd(res, cts):
    dx, dw = _BWD(res[0], res[1], *cts)
    return dx, dx, dw


_stand_in.defvjp(_stand_in_fwd, _stand_in_bwd)


def _loss(add_norm, w, x, r, probe):
    d = x.shape[-1]
    y, h = add_norm(x.reshape(-1, d), r.reshape(-1, d), w)
    return (y.reshape(x.shape) * probe).sum() + 0.3 * (h.reshape(x.shape) * probe[..., ::-1]).sum()


@pytest.mark.parametrize("scales", ["shared", "per_member"])
def test_row_batching_runs_the_fused_kernel_under_vmap(scales):
    """The gradient island's vmap (one scale) and a pipeline's (a scale per stage, nested) over a call
    with two row inputs and two row outputs: loss and gradients match plain jnp's."""
    k = jax.random.split(jax.random.key(3), 4)
    x, r, probe = (jax.random.normal(k[i], (2, 3, 5, 24)) for i in range(3))
    w = 1 + 0.1 * jax.random.normal(k[3], (2, 24) if scales == "per_member" else (24,))
    reference = lambda x2, r2, w: K.add_rmsnorm_reference(x2, r2, w, EPS)  # noqa: E731
    w_axis = 0 if scales == "per_member" else None

    def run(fn):
        grads = jax.value_and_grad(lambda w, x, r, p: _loss(fn, w, x, r, p), argnums=(0, 1, 2))
        return jax.jit(jax.vmap(jax.vmap(grads, (None, 0, 0, 0)), (w_axis, 0, 0, 0)))(w, x, r, probe)

    for a, b in zip(jax.tree.leaves(run(_stand_in)), jax.tree.leaves(run(reference))):
        _close(a, b, 1e-5)


# ------------------------------------------------------------------------------- the model's blocks


def _logits_and_grads(model, tokens, probe):
    from flax import nnx

    graphdef, state = nnx.split(model)

    def loss(state):
        logits, _ = nnx.merge(graphdef, state)(tokens)
        return (logits * probe).sum(), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return logits, grads


def test_blocks_with_deferred_adds_equal_the_separate_adds(make_config):
    """The stack whose residual adds run in the next norm (each block hands (stream, MLP output) on,
    the final norm adds the last) computes the separate adds' logits and parameter gradients."""
    from boost_jax.model import build_model

    cfg = make_config(**{"model.n_layers": 2})
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 256, (2, 12)))
    probe = jax.random.normal(jax.random.key(6), (2, 12, cfg.model.vocab_size))
    runs = {}
    for choice in ("fused", "separate"):
        model = build_model(cfg.model, seed=2, residual_norm=choice)
        assert model.fuse_residual == (choice == "fused")
        runs[choice] = _logits_and_grads(model, tokens, probe)
    (got, got_grads), (want, want_grads) = runs["fused"], runs["separate"]
    _close(got, want, 1e-5)
    assert jax.tree.structure(got_grads) == jax.tree.structure(want_grads)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        _close(a, b, 1e-4)
