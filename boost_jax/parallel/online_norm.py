"""Online RMSNorm fused with row-parallel A GEMMs: one all-reduce carries both (BOOST, exact).

With x split along d into x_i (width d_i) on the `tensor` axis, each device
  1. s_i = Σ x_i²;  H_i = (γ_i ⊙ x_i)·A_i                 (local partial product, x's dtype)
  2. [H, S] = Σ_i [H_i, s_i]                               (the A all-reduce; S rides beside H)
  3. Y = H / sqrt(S/d + eps)
so Y = (γ ⊙ x)·A / rms(x) exactly; the norm needs no collective of its own, and no local rms: a
local normalisation by rms_i = sqrt(s_i/d_i + eps) would cancel against H_i's rescale by rms_i, and
costs two passes over the f32 partial product each way (benchmarks/RESULTS.md 2026-11-28, online
norm without its local rms). The scaling by γ_i fuses into the GEMM's operand.

Step 1 runs per shard in `shard_map` and returns the partials stacked along a leading axis split
over `tensor`; the sum over that axis is the all-reduce. The reduced H and S are tagged for
activation checkpointing, so a low-rank remat policy recomputes only the local, collective-free part.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from boost_jax.parallel.rules import logical_spec, weight_einsum


@jax.custom_vjp
def _sum_parts(parts: jax.Array) -> jax.Array:
    """Σ over the leading (tensor-split) axis in the parts' own dtype: the all-reduce moves bf16 under
    bf16 compute, as Megatron's activation all-reduces do (jnp.sum would accumulate, and so
    all-reduce, in float32: twice the bytes). Its transpose broadcasts the cotangent back.
    Inside a shard_map over other axes (the 1F1B pipeline's stages) the sum is JAX's reduce_sum
    (a constant zero): the general reduce's traced adder carries a sharding annotation there, and
    XLA:CPU's bf16 all-reduce promotion fails on the copy it becomes."""
    if jax.sharding.get_abstract_mesh().manual_axes:
        return jax.lax.reduce(parts, np.zeros((), parts.dtype), jax.lax.add, (0,))
    return jax.lax.reduce(parts, jnp.zeros((), parts.dtype), jax.lax.add, (0,))


_sum_parts.defvjp(
    lambda parts: (_sum_parts(parts), parts.shape[0]), lambda n, g: (jnp.broadcast_to(g[None], (n, *g.shape)),)
)


def stored_stream(x: jax.Array) -> jax.Array:
    """The residual stream x (the sum of a residual add, read by the next online norm and the next add)
    stored in its own dtype between kernels. XLA compiling for an A100 computes a bf16 add in float32
    and, where it may keep excess precision, drops the float32 -> bf16 -> float32 round trip, so the
    stream and its gradient travel between kernels in float32 (twice the bytes of every read and write
    of the [T, d_i] shard, forward and backward). An optimization barrier on the sum keeps the round
    trip: the add's kernel writes x's dtype, the norm's statistics and scaled rows read it, and the
    barrier's transpose does the same for the gradient, whose one backward kernel (the norm's gradient
    plus the residual's) then writes x's dtype alone. The values are the program's own: a no-op under
    jnp semantics, and in float32 (CPU) nothing changes. The block applies it where its stack runs
    unrolled (model/transformer.py `Block.stores_stream`)."""
    return jax.lax.optimization_barrier(x)


def online_norm_matmul(x, scale, a_stack, *, eps: float, mesh, axis: str = "tensor", reduce_dtype=None):
    """x: [B, T, d] (d split over `axis`), scale: [d], a_stack: [g, d, r] -> [B, T, g, r] = norm(x)·A_g.
    `reduce_dtype`: the strategy's gradient-reduction dtype (parallel.grad_reduce_dtype)."""
    d = x.shape[-1]
    # The current rules' batch split (no `data` per replica) and sequence split (`context`).
    rows = tuple(logical_spec(("act_batch", "act_seq"), x.shape[:2]))
    batch, seq = (rows + (None, None))[:2]

    def local(x, scale, a):
        # H_i = (γ_i ⊙ x_i)·A_i: the local partial product needs no local rms (it would cancel), so the
        # GEMM reads the scaled rows (XLA fuses the scaling into its operand) and writes H_i in x's dtype.
        xs = (x.astype(jnp.float32) * scale).astype(x.dtype)
        h = weight_einsum("btd,gdr->btgr", xs, a)
        s = jnp.sum(jnp.square(x.astype(jnp.float32)), axis=-1)  # the local Σx²
        return h[None], s[None]

    # A enters widened to the gradient-reduction dtype (it was gathered in the compute dtype, so
    # nothing is lost): the sum of its gradient over the axes the map replicates it on is then in
    # that dtype too. The GEMM runs in x's dtype.
    if reduce_dtype is not None:  # widen only: the values are unchanged
        a_stack = a_stack.astype(jnp.promote_types(a_stack.dtype, reduce_dtype))
    h_parts, s_parts = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(batch, seq, axis), P(axis), P(None, axis, None)),
        out_specs=(P(axis, batch, seq, None, None), P(axis, batch, seq)),
    )(x, scale, a_stack)
    h = checkpoint_name(_sum_parts(h_parts), "lowrank")
    s = checkpoint_name(s_parts.sum(axis=0), "norm_stats")
    return (h.astype(jnp.float32) / jnp.sqrt(s / d + eps)[..., None, None]).astype(x.dtype)
