"""Pallas RMSNorm(+Σx²) kernel vs the jnp reference, in interpret mode on CPU.

The interpreter fills out-of-bounds block lanes with NaN, so any missing row/column mask in the
kernels shows up as NaN here: odd row counts and widths that are not powers of two test masking.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.errors import install_hint
from boost_jax.kernels import rmsnorm as K

EPS = 1e-6


def _inputs(shape, dtype, seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(ks[0], shape, jnp.float32).astype(dtype)
    w = (1.0 + 0.1 * jax.random.normal(ks[1], shape[-1:], jnp.float32)).astype(dtype)
    gy = jax.random.normal(ks[2], shape, jnp.float32)
    gs = jax.random.normal(ks[3], shape[:-1], jnp.float32)
    return x, w, gy, gs


def _fwd_and_grads(fn, x, w, gy, gs):
    """(y, s) and d/d(x, scale) of the random linear functional Σ y·gy + Σ s·gs, under jit."""

    def loss(x, w):
        y, s = fn(x, w)
        return jnp.sum(y.astype(jnp.float32) * gy) + jnp.sum(s * gs), (y, s)

    (_, (y, s)), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
    return y, s, dx, dw


def _close(a, b, rtol, atol_frac):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol_frac * float(np.abs(b).max()))


# (shape, block_rows): 1/7/13 rows, a 3-D input, widths 48/100/130/256; block_rows=4 gives
# several grid steps with a partial last block.
CASES = [((1, 48), None), ((7, 100), None), ((13, 130), 4), ((3, 5, 256), 4), ((13, 100), 2)]


@pytest.mark.parametrize("shape,block_rows", CASES)
def test_f32_matches_reference(shape, block_rows):
    x, w, gy, gs = _inputs(shape, jnp.float32, seed=len(shape) * 100 + shape[-1])
    got = _fwd_and_grads(lambda x, w: K.rmsnorm(x, w, EPS, block_rows=block_rows), x, w, gy, gs)
    ref = _fwd_and_grads(lambda x, w: K.rmsnorm_reference(x, w, EPS), x, w, gy, gs)
    assert got[0].dtype == jnp.float32 and got[1].dtype == jnp.float32
    assert got[1].shape == shape[:-1]
    for a, b in zip(got, ref):  # y, s, dx, dscale
        _close(a, b, rtol=1e-5, atol_frac=1e-6)


@pytest.mark.parametrize("shape,block_rows", [((7, 100), None), ((3, 5, 130), 4)])
def test_bf16_matches_reference(shape, block_rows):
    x, w, gy, gs = _inputs(shape, jnp.bfloat16, seed=7)
    got = _fwd_and_grads(lambda x, w: K.rmsnorm(x, w, EPS, block_rows=block_rows), x, w, gy, gs)
    ref = _fwd_and_grads(lambda x, w: K.rmsnorm_reference(x, w, EPS), x, w, gy, gs)
    assert [a.dtype for a in got] == [jnp.bfloat16, jnp.float32, jnp.bfloat16, jnp.bfloat16]
    for a, b in zip(got, ref):
        _close(a, b, rtol=2e-2, atol_frac=1e-2)


def test_nan_stays_in_its_row():
    x, w, gy, gs = _inputs((13, 100), jnp.float32, seed=3)
    x = x.at[5, 17].set(jnp.nan)
    y, s, dx, dw = _fwd_and_grads(lambda x, w: K.rmsnorm(x, w, EPS, block_rows=4), x, w, gy, gs)
    yr, sr, dxr, _ = _fwd_and_grads(lambda x, w: K.rmsnorm_reference(x, w, EPS), x, w, gy, gs)
    assert np.isnan(y[5]).all() and np.isnan(s[5]) and np.isnan(dx[5]).all()
    assert np.isnan(dw).all()  # dscale sums over every row, NaN row included (as the reference)
    others = np.arange(13) != 5
    assert np.isfinite(y[others]).all() and np.isfinite(dx[others]).all()
    _close(y[others], yr[others], 1e-5, 1e-6)
    _close(s[others], sr[others], 1e-5, 1e-6)
    _close(dx[others], dxr[others], 1e-5, 1e-6)


def test_xla_impl_is_reference():
    x, w, _, _ = _inputs((2, 3, 48), jnp.float32, seed=1)
    for a, b in zip(K.rmsnorm(x, w, EPS, impl="xla"), K.rmsnorm_reference(x, w, EPS)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError):
        K.rmsnorm(x, w, EPS, block_rows=3)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the fallback is what CPU does; GPUs compile")
def test_compiled_on_cpu_falls_back_with_one_warning(monkeypatch):
    # CPU has no compiled Pallas lowering: the probe fails, we warn once and use the XLA path.
    monkeypatch.setattr(K, "_WARNED", False)
    monkeypatch.setattr(K, "_LOWERS", {})
    x, w, gy, gs = _inputs((7, 48), jnp.float32, seed=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _fwd_and_grads(lambda x, w: K.rmsnorm(x, w, EPS, interpret=False), x, w, gy, gs)
        K.rmsnorm(x.astype(jnp.bfloat16), w, EPS, interpret=False)  # new probe key, no 2nd warning
    msgs = [str(c.message) for c in caught if "falling back" in str(c.message)]
    assert len(msgs) == 1, msgs
    ref = _fwd_and_grads(lambda x, w: K.rmsnorm_reference(x, w, EPS), x, w, gy, gs)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_eps_zero_padded_rows_stay_out_of_dscale():
    # eps=0: a zero-filled out-of-range row has rsqrt(0)=inf; it must not poison dscale.
    x, w, gy, gs = _inputs((7, 48), jnp.float32, seed=5)
    got = _fwd_and_grads(lambda x, w: K.rmsnorm(x, w, 0.0, block_rows=4), x, w, gy, gs)
    ref = _fwd_and_grads(lambda x, w: K.rmsnorm_reference(x, w, 0.0), x, w, gy, gs)
    for a, b in zip(got, ref):
        _close(a, b, rtol=1e-5, atol_frac=1e-6)


# Widths that are not powers of two: 3200 = 2048+1024+128 lanes; 1000 and 21 end in a remainder
# below the 16-lane minimum (one overlapping, masked piece); 10 is narrower than 16.
@pytest.mark.parametrize("shape", [(3, 3200), (5, 1000), (9, 21), (3, 10)])
def test_any_width_matches_reference(shape):
    x, w, gy, gs = _inputs(shape, jnp.float32, seed=shape[-1])
    got = _fwd_and_grads(lambda x, w: K.rmsnorm(x, w, EPS, block_rows=2), x, w, gy, gs)
    ref = _fwd_and_grads(lambda x, w: K.rmsnorm_reference(x, w, EPS), x, w, gy, gs)
    for a, b in zip(got, ref):
        _close(a, b, rtol=1e-5, atol_frac=1e-6)


def test_scale_partials_are_a_fixed_grid_not_one_row_per_block():
    """600 rows in blocks of 2 = 300 row blocks; the backward's partial dscale is [128, d] (each of
    128 programs loops over its blocks, some past the end), and the result still matches."""
    shape = (600, 20)
    x, w, gy, gs = _inputs(shape, jnp.float32, seed=11)
    fn = lambda x, w: K.rmsnorm(x, w, EPS, block_rows=2)  # noqa: E731
    jaxpr = jax.make_jaxpr(
        jax.grad(lambda x, w: jnp.sum(fn(x, w)[0] * gy) + jnp.sum(fn(x, w)[1] * gs), argnums=(0, 1))
    )(x, w)
    text = str(jaxpr)
    assert "f32[128,20]" in text and "f32[300,20]" not in text
    got = _fwd_and_grads(fn, x, w, gy, gs)
    ref = _fwd_and_grads(lambda x, w: K.rmsnorm_reference(x, w, EPS), x, w, gy, gs)
    for a, b in zip(got, ref):
        _close(a, b, rtol=1e-5, atol_frac=1e-6)


@pytest.mark.parametrize("d", [3200, 4096, 100])
def test_kernels_lower_to_triton_for_cuda(d):
    """The compiled (not interpreted) kernels lower for an NVIDIA GPU from this CPU host."""
    x = jax.ShapeDtypeStruct((64, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((d,), jnp.float32)

    def f(x, w):
        loss = lambda x, w: K._rmsnorm_pallas(x, w, 1e-6, 4, False)[0].astype(jnp.float32).sum()  # noqa: E731
        return jax.grad(loss, argnums=(0, 1))(x, w)

    text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 2  # the forward and backward kernels


def test_fallback_is_recorded(monkeypatch):
    monkeypatch.setattr(K, "_WARNED", True)  # the warning itself is covered above
    monkeypatch.setattr(K, "_LOWERS", {})
    K.kernels_used()  # clear
    x, w, _, _ = _inputs((7, 48), jnp.float32, seed=2)
    K.rmsnorm(x, w, EPS, interpret=False)
    assert K.kernels_used()["rmsnorm"].startswith("xla (pallas did not lower: ")
    K.rmsnorm(x, w, EPS)  # the CPU interpreter
    assert K.kernels_used() == {"rmsnorm": "pallas (interpreted)"}


def test_training_run_records_the_kernel_that_ran(make_config):
    from tests_support import metric_rows

    from boost_jax import train

    cfg = make_config(**{"kernels.rmsnorm": "pallas", "train.steps": 2, "train.stop_at_step": 1, "train.eval_every": 0})
    train.run(cfg)
    assert metric_rows(cfg.run_dir, "kernels") == {1: {"rmsnorm": "pallas (interpreted)"}}


# ------------------------------------------------------------------- kernels.rmsnorm=triton (jax-triton)


def test_triton_impl_without_a_gpu_falls_back_loudly_and_is_recorded(monkeypatch):
    # jax-triton kernels run on NVIDIA GPUs only: elsewhere one warning naming the field and the fix.
    monkeypatch.setattr(K, "_WARNED", False)
    monkeypatch.setattr(K, "_LOWERS", {})
    K.kernels_used()
    x, w, gy, gs = _inputs((7, 48), jnp.float32, seed=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _fwd_and_grads(lambda x, w: K.rmsnorm(x, w, EPS, impl="triton"), x, w, gy, gs)
    msgs = [str(c.message) for c in caught if "falling back" in str(c.message)]
    assert len(msgs) == 1 and "kernels.rmsnorm=triton" in msgs[0] and install_hint("gpu") in msgs[0], msgs
    assert K.kernels_used()["rmsnorm"].startswith("xla (triton unavailable: ")
    ref = _fwd_and_grads(lambda x, w: K.rmsnorm_reference(x, w, EPS), x, w, gy, gs)
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)


def test_config_names_the_kernel_choices(make_config):
    from boost_jax.errors import ConfigError
    from boost_jax.validate import validate

    validate(make_config(**{"kernels.rmsnorm": "triton"}))
    with pytest.raises(ConfigError, match="kernels.rmsnorm"):
        validate(make_config(**{"kernels.rmsnorm": "cuda"}))


@pytest.mark.parametrize("dtype,d", [(jnp.bfloat16, 3200), (jnp.float32, 100)])
def test_triton_kernels_compile_for_h100_without_a_gpu(dtype, d):
    """Triton compiles both kernels to PTX and a cubin for sm_90 on this CPU host (its bundled
    ptxas); row starts are 16-byte aligned when d % 8 == 0, so the row loads are 128-bit."""
    pytest.importorskip("triton", reason="needs triton (pip install triton; on GPUs the `gpu` extra)")
    from boost_jax.kernels import rmsnorm_triton as T

    kernels = T.compile_for_cuda(dtype, jnp.float32, n_rows=64, d=d)
    for name, ck in kernels.items():
        assert ".target sm_90" in ck.asm["ptx"] and len(ck.asm["cubin"]) > 1000, name
    if d % 8 == 0:
        assert "ld.global.v4.b32" in kernels["fwd"].asm["ptx"] and "ld.global.v4.b32" in kernels["bwd"].asm["ptx"]


def test_triton_kernels_interpreted_match_reference(tmp_path):
    """The Triton kernels run under Triton's CPU interpreter (a subprocess: TRITON_INTERPRET=1 must
    precede the import of triton) against the jnp reference and its autodiff."""
    pytest.importorskip("triton", reason="needs triton (pip install triton; on GPUs the `gpu` extra)")
    import os
    import subprocess
    import sys
    from pathlib import Path

    # (shape, dtype, rows, eps, backward programs): partial last blocks, widths that are not powers of
    # two, eps = 0, bfloat16, and 13 rows in blocks of 2 = 7 blocks on 3 backward programs (3, 2, 2
    # blocks each: the strided loop that spreads any row count over the <= 512 programs on a GPU).
    cases = [
        ((7, 100), jnp.float32, 2, EPS, 0),
        ((13, 130), jnp.float32, 4, 0.0, 0),
        ((13, 20), jnp.float32, 2, EPS, 3),
        ((5, 48), jnp.bfloat16, 2, EPS, 0),
    ]
    arrays, inputs = {}, []
    for i, (shape, dtype, rows, eps, programs) in enumerate(cases):
        x, w, gy, gs = _inputs(shape, dtype, seed=20 + i)
        inputs.append((x, w.astype(jnp.float32), gy, gs))
        as_np = lambda a: np.asarray(a.view(jnp.uint16) if a.dtype == jnp.bfloat16 else a)  # noqa: E731
        arrays.update(
            {
                f"x{i}": as_np(x),
                f"w{i}": np.asarray(inputs[-1][1]),
                f"dy{i}": as_np(gy.astype(dtype)),
                f"ds{i}": np.asarray(gs),
                f"eps{i}": eps,
                f"rows{i}": rows,
                f"programs{i}": programs,
                f"x{i}_dtype": jnp.dtype(dtype).name,
            }
        )

    def references(inputs):  # every case's (y, s, dx, dscale) in one compiled program
        out = []
        for (x, w, gy, gs), (_, _, _, eps, _) in zip(inputs, cases):
            (y, s), vjp = jax.vjp(lambda x, w, eps=eps: K.rmsnorm_reference(x, w, eps), x, w)
            out.append((y, s, *vjp((gy.astype(y.dtype), gs))))
        return out

    refs = jax.jit(references)(inputs)
    np.savez(tmp_path / "cases.npz", **arrays)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [
            sys.executable,
            str(root / "tests" / "triton_interpreted.py"),
            str(tmp_path / "cases.npz"),
            str(tmp_path / "out.npz"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = np.load(tmp_path / "out.npz")
    for i, (shape, dtype, *_) in enumerate(cases):
        got = [out[f"{k}{i}"] for k in ("y", "s", "dx", "dw")]
        if dtype == jnp.bfloat16:
            got[0], got[2] = (jnp.asarray(a).view(jnp.bfloat16) for a in (got[0], got[2]))
        rtol, atol = (2e-2, 1e-2) if dtype == jnp.bfloat16 else (1e-5, 1e-6)
        for a, b in zip(got, refs[i]):  # y, s, dx, dscale
            _close(a, b, rtol=rtol, atol_frac=atol)
