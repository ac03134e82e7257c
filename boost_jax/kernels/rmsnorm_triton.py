"""The fused RMSNorm(+Σx²) forward and backward as Triton kernels, called from JAX through jax-triton,
and the residual add fused with the norm that reads it (`add_rmsnorm_rows`).

`kernels.rmsnorm=triton` runs these; `boost_jax/kernels/rmsnorm.py` is the interface (and the
probe-then-fall-back logic shared with the Pallas kernels). Same math and outputs as the Pallas
kernels; the fused add + norm takes the residual stream x and a branch's output r: h = x + r,
y = rmsnorm(h)·scale, and its backward returns dx = dr = dh + the norm's dh in the same pass.
Why a second implementation (JAX 0.11 deprecates the Pallas Triton backend), the math and the block
layout: the comments below.

This module imports `triton` at import time and `jax_triton` only when a kernel is called, so
`compile_for_cuda` (used by the tests) runs on a CPU-only host with just `triton` installed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from boost_jax.kernels import platform, row_batching

# The math, for x [R, d], scale [d]:
#
#     s = Σ_d x² (float32),  y = x · rsqrt(s/d + eps) · scale,
#     dx = dy·w·r - x·(Σ dy·w·x)·r³/d + 2·x·ds,  dscale = Σ_rows dy·x·r.
#
# The fused add + norm takes the residual stream x and a branch's output r: h = x + r (stored in x's
# dtype), y = rmsnorm(h)·scale; its backward gets dy and dh (h's own gradient, from the stream's next
# add) and returns dx = dr = dh + the norm's dh, so neither the add nor the gradient sum is a separate
# pass over the rows.
#
# Why a second implementation: JAX 0.11 deprecates the Pallas Triton backend ("to keep using Triton,
# switch to the official Triton bindings and jax_triton", the Pallas changelog for 0.11.0), so when
# Pallas-on-Triton stops lowering on a GPU image these kernels still run natively.
#
# Layout: a forward program owns `ROWS` rows and the whole row, one power-of-two `BLOCK_D` >= d wide
# (masked lanes read 0 and are not stored; d is a compile-time constant, so row starts are provably
# 16-byte aligned for d % 8 == 0 and the loads vectorise). The backward runs a fixed grid of at most
# `MAX_PROGRAMS` programs, each looping over every `MAX_PROGRAMS`-th row block and keeping its partial
# dscale in registers; the [programs, d] float32 partials are summed outside the kernel (no atomics).

_F32 = jnp.float32
MAX_PROGRAMS = 512  # the backward's grid cap: partials are [<=512, d] float32 (8 MiB at d=4096)


@triton.jit
def rmsnorm_fwd_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    s_ptr,
    n_rows: tl.constexpr,
    d: tl.constexpr,
    eps: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < n_rows
    cmask = cols < d
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * d + cols[None, :]  # int64: R·d may pass 2**31
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sum(x * x, axis=1)
    r = tl.rsqrt(s / d + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (x * r[:, None] * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows, s, mask=rmask)


@triton.jit
def _norm_backward(x, dy, w, rmask, d: tl.constexpr, eps: tl.constexpr):
    """(the norm's dx, the rows' dscale contribution) of a block of rows x [ROWS, BLOCK_D] in float32.
    r = 0 on rows past the end keeps them out of dscale even when eps = 0 (rsqrt(0) = inf)."""
    r = tl.where(rmask, tl.rsqrt(tl.sum(x * x, axis=1) / d + eps), 0.0)
    dyw = dy * w[None, :]
    c = tl.sum(dyw * x, axis=1) * (r * r * r) / d
    return dyw * r[:, None] - x * c[:, None], tl.sum(dy * x * r[:, None], axis=0)


@triton.jit
def rmsnorm_bwd_kernel(
    x_ptr,
    w_ptr,
    dy_ptr,
    ds_ptr,
    dx_ptr,
    dw_ptr,
    n_rows: tl.constexpr,
    d: tl.constexpr,
    eps: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PROGRAMS: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < d
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    # Static trip count (every program the same; a block past the end is fully masked): the loop
    # bounds stay compile-time constants, which Triton's interpreter also needs.
    for step in range(0, tl.cdiv(tl.cdiv(n_rows, ROWS), PROGRAMS)):
        rows = (pid + step * PROGRAMS) * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        ds = tl.load(ds_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        dx, dw = _norm_backward(x, dy, w, rmask, d, eps)
        tl.store(dx_ptr + offs, (dx + 2.0 * x * ds[:, None]).to(dx_ptr.dtype.element_ty), mask=mask)
        acc += dw
    tl.store(dw_ptr + pid * d + cols, acc, mask=cmask)


@triton.jit
def add_rmsnorm_fwd_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    y_ptr,
    h_ptr,
    n_rows: tl.constexpr,
    d: tl.constexpr,
    eps: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < n_rows
    cmask = cols < d
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # h is stored in its own dtype and normalised as stored, so the backward (which reads h back)
    # and a separate add followed by the norm see the same values.
    h = (x + r).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + offs, h, mask=mask)
    hf = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(hf * hf, axis=1) / d + eps)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (hf * inv[:, None] * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def add_rms_fwd_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    h_ptr,
    inv_ptr,
    n_rows: tl.constexpr,
    d: tl.constexpr,
    eps: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # add_rmsnorm_fwd_kernel without y: h and each row's rsqrt(mean h² + eps) (float32), for a GEMM
    # that normalises the rows it loads (kernels/norm_gemm.py). w_ptr (the scale) is not read.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < d)[None, :]
    offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + offs, h, mask=mask)
    hf = h.to(tl.float32)
    tl.store(inv_ptr + rows, tl.rsqrt(tl.sum(hf * hf, axis=1) / d + eps), mask=rmask)


@triton.jit
def add_rmsnorm_bwd_kernel(
    h_ptr,
    w_ptr,
    dy_ptr,
    dh_ptr,
    dx_ptr,
    dw_ptr,
    n_rows: tl.constexpr,
    d: tl.constexpr,
    eps: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PROGRAMS: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < d
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for step in range(0, tl.cdiv(tl.cdiv(n_rows, ROWS), PROGRAMS)):
        rows = (pid + step * PROGRAMS) * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * d + cols[None, :]
        h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dx, dw = _norm_backward(h, dy, w, rmask, d, eps)
        # the norm's gradient plus the residual stream's own: x and the residual get the same dx
        tl.store(dx_ptr + offs, (dx + dh).to(dx_ptr.dtype.element_ty), mask=mask)
        acc += dw
    tl.store(dw_ptr + pid * d + cols, acc, mask=cmask)


# ------------------------------------------------------------------------------------- launch plan


def block_d(d: int) -> int:
    return triton.next_power_of_2(d)


def default_rows(d: int) -> int:
    """Rows per program: ~4K elements per block (the row itself when wider), at most 16."""
    return max(1, min(16, 4096 // block_d(d)))


def num_warps(rows: int, d: int) -> int:
    elements = rows * block_d(d)  # held in registers: more warps for wider blocks
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


def programs(n_rows: int, rows: int) -> int:
    return max(1, min(triton.cdiv(n_rows, rows), MAX_PROGRAMS))


# ------------------------------------------------------------------------------------ jax-triton calls


def _jt():
    import jax_triton  # the `gpu` extra; needs a CUDA jaxlib (it is imported lazily for that reason)

    return jax_triton


def _target():
    """jax-triton asks the driver for the compute capability; a target without a device (a deviceless
    compile, kernels/platform.py) names it instead."""
    cc = platform.compute_capability() if platform.device() is not None else None
    return {} if cc is None else {"compute_capability": cc}


def _launch(kernel, name, inputs, out_shape, grid, eps, rows, **consts):
    """One jax-triton launch of a norm kernel over rows of width d (the first input's last axis)."""
    n_rows, d = inputs[0].shape
    return _jt().triton_call(
        *inputs,
        kernel=kernel,
        out_shape=out_shape,
        grid=grid,
        num_warps=num_warps(rows, d),
        num_stages=1,
        name=name,
        **_target(),
        n_rows=n_rows,
        d=d,
        eps=eps,
        ROWS=rows,
        BLOCK_D=block_d(d),
        **consts,
    )


def _forward(kernel, name, inputs, outputs, eps, rows):
    grid = (triton.cdiv(inputs[0].shape[0], rows),)
    return _launch(kernel, name, inputs, outputs, grid, eps, rows)


def _backward(kernel, name, inputs, eps, rows):
    """(dx, dscale): each program's partial scale gradient summed here."""
    x2, scale = inputs[0], inputs[1]
    p = programs(x2.shape[0], rows)
    outputs = [jax.ShapeDtypeStruct(x2.shape, x2.dtype), jax.ShapeDtypeStruct((p, x2.shape[1]), _F32)]
    dx, dw_part = _launch(kernel, name, inputs, outputs, (p,), eps, rows, PROGRAMS=p)
    return dx, jnp.sum(dw_part, axis=0).astype(scale.dtype)


def fwd_call(x2, scale, eps, rows):
    outputs = [jax.ShapeDtypeStruct(x2.shape, x2.dtype), jax.ShapeDtypeStruct((x2.shape[0],), _F32)]
    return _forward(rmsnorm_fwd_kernel, "rmsnorm_fwd", (x2, scale), outputs, eps, rows)


def bwd_call(x2, scale, dy, ds, eps, rows):
    return _backward(rmsnorm_bwd_kernel, "rmsnorm_bwd", (x2, scale, dy, ds), eps, rows)


def add_fwd_call(x2, r2, scale, eps, rows):
    row = jax.ShapeDtypeStruct(x2.shape, x2.dtype)
    return _forward(add_rmsnorm_fwd_kernel, "add_rmsnorm_fwd", (x2, r2, scale), [row, row], eps, rows)


def add_rms_call(x2, r2, scale, eps, rows):
    """(h = x2 + r2, rsqrt(mean(h²) + eps) [R] float32): `add_fwd_call` without y (scale unread)."""
    outs = [jax.ShapeDtypeStruct(x2.shape, x2.dtype), jax.ShapeDtypeStruct((x2.shape[0],), _F32)]
    return _forward(add_rms_fwd_kernel, "add_rms_fwd", (x2, r2, scale), outs, eps, rows)


def add_bwd_call(h2, scale, dy, dh, eps, rows):
    return _backward(add_rmsnorm_bwd_kernel, "add_rmsnorm_bwd", (h2, scale, dy, dh), eps, rows)


@functools.lru_cache(maxsize=None)
def _calls(eps, rows):
    """The forward and backward calls for (eps, rows), batched by vmap through `row_batching` (a
    jax-triton call has no batching rule of its own; the trainer vmaps the model in its
    data-parallel gradient island and its pipeline stages)."""
    fwd = row_batching.forward(lambda x2, scale: fwd_call(x2, scale, eps, rows))
    bwd = row_batching.backward(lambda x2, scale, dy, ds: bwd_call(x2, scale, dy, ds, eps, rows))
    return fwd, bwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rmsnorm_rows(x2, scale, eps, rows):
    """x2 [R, d], scale [d] -> (y [R, d] in x2.dtype, s [R] float32). eps, rows static."""
    return _calls(eps, rows)[0](x2, scale)


def _vjp_fwd(x2, scale, eps, rows):
    return _calls(eps, rows)[0](x2, scale), (x2, scale)


def _vjp_bwd(eps, rows, res, cts):
    x2, scale = res
    dy, ds = cts
    return _calls(eps, rows)[1](x2, scale, dy.astype(x2.dtype), ds.astype(_F32))


rmsnorm_rows.defvjp(_vjp_fwd, _vjp_bwd)


@functools.lru_cache(maxsize=None)
def _add_calls(eps, rows):
    """`_calls` for the fused residual add + norm."""
    fwd = row_batching.forward(lambda x2, r2, scale: add_fwd_call(x2, r2, scale, eps, rows))
    bwd = row_batching.backward(lambda h2, scale, dy, dh: add_bwd_call(h2, scale, dy, dh, eps, rows))
    return fwd, bwd, row_batching.forward(lambda x2, r2, scale: add_rms_call(x2, r2, scale, eps, rows))


def add_rms_rows(x2, r2, scale, eps, rows):
    """(h = x2 + r2 [R, d], rsqrt(mean(h²) + eps) [R] float32), not differentiated: the caller's
    custom_vjp runs `add_rmsnorm_bwd_rows` with the normalised rows' gradient."""
    return _add_calls(eps, rows)[2](x2, r2, scale)


def add_rmsnorm_bwd_rows(h2, scale, dy, dh, eps, rows):
    """(dx = dr, dscale) of y = rmsnorm(h)·scale, h = x + r, from dy and h's own gradient dh."""
    return _add_calls(eps, rows)[1](h2, scale, dy.astype(h2.dtype), dh.astype(h2.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def add_rmsnorm_rows(x2, r2, scale, eps, rows):
    """x2, r2 [R, d] (one dtype), scale [d] -> (y = rmsnorm(h) [R, d], h = x2 + r2 [R, d]). eps, rows static."""
    return _add_calls(eps, rows)[0](x2, r2, scale)


def _add_vjp_fwd(x2, r2, scale, eps, rows):
    y, h = _add_calls(eps, rows)[0](x2, r2, scale)
    return (y, h), (h, scale)


def _add_vjp_bwd(eps, rows, res, cts):
    h2, scale = res
    dy, dh = cts
    dx, dscale = _add_calls(eps, rows)[1](h2, scale, dy.astype(h2.dtype), dh.astype(h2.dtype))
    return dx, dx, dscale


add_rmsnorm_rows.defvjp(_add_vjp_fwd, _add_vjp_bwd)


# ------------------------------------------------------------------- ahead-of-time compile (no GPU)

_TRITON_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def compile_for_cuda(
    x_dtype, scale_dtype, n_rows: int, d: int, *, eps: float = 1e-6, rows: int | None = None, capability: int = 90
) -> dict:
    """Compile the kernels for an NVIDIA GPU of compute `capability` (90: H100/H200) without one:
    {"fwd"|"bwd"|"add_fwd"|"add_rms"|"add_bwd": triton's CompiledKernel (asm["ptx"], asm["cubin"],
    metadata)}. Pointers are declared 16-byte aligned, the assumption jax-triton makes for every array it passes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows = rows or default_rows(d)
    xt, wt = _TRITON_TYPES[jnp.dtype(x_dtype).name], _TRITON_TYPES[jnp.dtype(scale_dtype).name]
    target = GPUTarget("cuda", capability, 32)
    consts = dict(n_rows=n_rows, d=d, eps=eps, ROWS=rows, BLOCK_D=block_d(d))
    plans = {
        "fwd": (rmsnorm_fwd_kernel, [f"*{xt}", f"*{wt}", f"*{xt}", "*fp32"], consts),
        "bwd": (
            rmsnorm_bwd_kernel,
            [f"*{xt}", f"*{wt}", f"*{xt}", "*fp32", f"*{xt}", "*fp32"],
            {**consts, "PROGRAMS": programs(n_rows, rows)},
        ),
        "add_fwd": (add_rmsnorm_fwd_kernel, [f"*{xt}", f"*{xt}", f"*{wt}", f"*{xt}", f"*{xt}"], consts),
        "add_rms": (add_rms_fwd_kernel, [f"*{xt}", f"*{xt}", f"*{wt}", f"*{xt}", "*fp32"], consts),
        "add_bwd": (
            add_rmsnorm_bwd_kernel,
            [f"*{xt}", f"*{wt}", f"*{xt}", f"*{xt}", f"*{xt}", "*fp32"],
            {**consts, "PROGRAMS": programs(n_rows, rows)},
        ),
    }
    out = {}
    with _cache_dir():
        for name, (kernel, pointers, constexprs) in plans.items():
            signature = dict(zip(kernel.arg_names, pointers))
            signature.update({k: "constexpr" for k in constexprs})
            attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}
            source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
            out[name] = triton.compile(
                source, target=target, options={"num_warps": num_warps(rows, d), "num_stages": 1}
            )
    return out


@contextlib.contextmanager
def _cache_dir():
    """triton.compile needs a cache directory; jax-triton's import sets TRITON_CACHE_DIR to "" (it
    keeps its own), so once it is imported a direct compile gets a temporary one."""
    if os.environ.get("TRITON_CACHE_DIR") != "":
        yield
        return
    with tempfile.TemporaryDirectory() as folder:
        os.environ["TRITON_CACHE_DIR"] = folder
        try:
            yield
        finally:
            os.environ["TRITON_CACHE_DIR"] = ""
