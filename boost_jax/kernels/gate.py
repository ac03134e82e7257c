"""The MLP's gate·up product as one Pallas kernel each way: h = act(g)·u, and (dg, du) from dh in one pass.

    h = gate_product(g, u, act="none" | "silu", impl="pallas" | "xla")   # g, u: [..., F]

act="none" is CoLA's larger models' down(gate·up), "silu" SwiGLU's down(silu(gate)·up). Left to XLA,
the backward is two loop fusions, dg = dh·u·act'(g) and du = dh·act(g), each reading dh, g and u (six
passes over [B, T, F]); the kernel's backward reads them once and writes dg and du (five), float32
math stored in the inputs' dtype. `gate_reference` is the plain-jnp product (impl="xla" runs it).
Elements are addressed as one flat vector in power-of-two blocks; the last block starts at n - block
(never out of bounds) and masks the elements the previous block wrote. On CPU the kernel runs in
Pallas's interpreter; under vmap the batch is more elements (one call). `model.gate_kernel` chooses it
(model/autos.py); where the kernels do not compile, XLA's product runs, with a warning.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental import pallas as pl

from boost_jax.kernels import platform

try:  # Pallas's Triton backend (deprecated in jax 0.11; kernels/rmsnorm.py says why it is pinned)
    from jax.experimental.pallas import triton as plgpu

    _PARAMS = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed jax
    plgpu = _PARAMS = None

_F32 = jnp.float32
ACTS = ("none", "silu")
BLOCK = 4096  # elements per program (a power of two, as Triton's blocks must be)


def gate_reference(g: jax.Array, u: jax.Array, act: str = "none") -> jax.Array:
    """act(g)·u in the inputs' dtype (plain jnp: what autodiff differentiates)."""
    return (jax.nn.silu(g) if act == "silu" else g) * u


def _block(pid, n, block):
    start = jnp.minimum(pid * block, n - block)
    idx = start + jnp.arange(block)
    return start, idx >= pid * block


def _gate_fwd(g_ref, u_ref, h_ref, *, n, block, act):
    start, mask = _block(pl.program_id(0), n, block)
    at = pl.ds(start, block)
    g = plgpu.load(g_ref.at[at], mask=mask, other=0.0).astype(_F32)
    u = plgpu.load(u_ref.at[at], mask=mask, other=0.0).astype(_F32)
    a = g * jax.nn.sigmoid(g) if act == "silu" else g
    plgpu.store(h_ref.at[at], (a * u).astype(h_ref.dtype), mask=mask)


def _gate_bwd(g_ref, u_ref, dh_ref, dg_ref, du_ref, *, n, block, act):
    start, mask = _block(pl.program_id(0), n, block)
    at = pl.ds(start, block)
    g = plgpu.load(g_ref.at[at], mask=mask, other=0.0).astype(_F32)
    u = plgpu.load(u_ref.at[at], mask=mask, other=0.0).astype(_F32)
    dh = plgpu.load(dh_ref.at[at], mask=mask, other=0.0).astype(_F32)
    if act == "silu":
        sig = jax.nn.sigmoid(g)
        a, da = g * sig, sig * (1.0 + g * (1.0 - sig))
    else:
        a, da = g, 1.0
    plgpu.store(dg_ref.at[at], (dh * u * da).astype(dg_ref.dtype), mask=mask)
    plgpu.store(du_ref.at[at], (dh * a).astype(du_ref.dtype), mask=mask)


def _call(kernel, inputs, n_out, act, interpret):
    """The kernel on same-shape inputs, as one flat vector; vmapped, on the batched arrays (elementwise:
    a batch is more elements), unbatched inputs broadcast."""

    @custom_vmap
    def call(*xs):
        shape = xs[0].shape
        n = xs[0].size
        block = min(BLOCK, 1 << (n.bit_length() - 1))
        like = jax.ShapeDtypeStruct((n,), xs[0].dtype)
        out = pl.pallas_call(
            functools.partial(kernel, n=n, block=block, act=act),
            grid=(pl.cdiv(n, block),),
            out_shape=[like] * n_out,
            compiler_params=_PARAMS(num_warps=4, num_stages=1),
            interpret=interpret,
            name=kernel.__name__.strip("_"),
        )(*(x.reshape(-1) for x in xs))
        return tuple(o.reshape(shape) for o in out)

    @call.def_vmap
    def rule(size, in_batched, *xs):
        xs = [x if b else jnp.broadcast_to(x, (size, *x.shape)) for x, b in zip(xs, in_batched)]
        return call(*xs), (True,) * n_out

    return call(*inputs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _gate_flat(g, u, act, interpret):
    return _call(_gate_fwd, (g, u), 1, act, interpret)[0]


def _vjp_fwd(g, u, act, interpret):
    return _gate_flat(g, u, act, interpret), (g, u)


def _vjp_bwd(act, interpret, res, dh):
    g, u = res
    dg, du = _call(_gate_bwd, (g, u, dh.astype(g.dtype)), 2, act, interpret)
    return dg, du


_gate_flat.defvjp(_vjp_fwd, _vjp_bwd)


def gate_product(g: jax.Array, u: jax.Array, act: str = "none", *, impl: str = "pallas", interpret=None):
    """act(g)·u (g, u of one shape and dtype). impl="pallas": the kernels above (interpreted on CPU
    unless `interpret` says otherwise); "xla": `gate_reference`."""
    if act not in ACTS:
        raise ValueError(f"unknown gate activation {act!r}; one of {ACTS}")
    if impl == "xla" or g.size == 0:
        return gate_reference(g, u, act)
    if impl != "pallas":
        raise ValueError(f"model.gate_kernel={impl!r}: set pallas, xla or auto")
    if g.shape != u.shape or g.dtype != u.dtype:
        raise ValueError(f"gate and up differ: {g.shape} {g.dtype} vs {u.shape} {u.dtype}")
    if interpret is None:
        interpret = platform.name() == "cpu"
    failure = "over 2**31 elements (the flat index is int32)" if g.size >= 2**31 else _lowers(g.dtype, act, interpret)
    if failure:
        return gate_reference(g, u, act)
    return _gate_flat(g, u, act, bool(interpret))


_LOWERS: dict = {}  # (backend, device kind, dtype, act, interpret) -> "" when the kernels compile, else why not


def _lowers(dtype, act, interpret) -> str:
    """Compile both kernels once per target, dtype and activation on one block; the reason when they
    cannot (warned once, and XLA's product runs)."""
    kind = str(getattr(platform.device(), "device_kind", ""))
    key = (platform.name(), kind, jnp.dtype(dtype).name, act, interpret)

    def compile_probe():
        if plgpu is None:
            raise ImportError("this jax has no Pallas Triton backend")
        x = platform.abstract((BLOCK + 1,), dtype)
        step = lambda g, u: jax.vjp(lambda g, u: _gate_flat(g, u, act, interpret), g, u)[1](g)  # noqa: E731
        jax.jit(step).lower(x, x).compile()

    def warn(reason):
        warnings.warn(
            f"boost_jax gate: the Pallas gate kernel does not compile here ({reason}); the MLP's "
            "gate product runs on XLA (model.gate_kernel=xla says so without this warning)",
            stacklevel=5,
        )

    return platform.probe_once(_LOWERS, key, compile_probe, warn)
