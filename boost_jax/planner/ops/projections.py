"""The projection groups (qkv, o, mlp_in, mlp_out): which partition choices can run a group on a tensor
size (`group_choices`), the work of one under its split (`group_op`: tensor-parallel stages or st's
P(n x n) on the fsdp x tensor grid) and what a strategy's stored layouts add to st (`st_stored`)."""

from __future__ import annotations

import types

from boost_jax.config import PROJECTION_GROUPS as GROUPS
from boost_jax.config import ST
from boost_jax.planner.ops.kept_arrays import (
    GPU_KEPT_ONLINE_NORM32,
    GPU_SAVED_ONLINE_NORM32,
    GPU_SIGMA_IN_GEMM,
    GPU_UNROLLED_SIGMA,
    SAVED_LINEAR,
    SAVED_ONLINE_NORM,
    SAVED_SIGMA,
)
from boost_jax.planner.ops.operators import Block, Coll, Ctx, Gemm, Op, StMatmul, divides, gpu, kernels_in_gemms
from boost_jax.planner.ops.strategy_tables import GRID, NONE, Split, strategy_layers


def group_choices(ctx: Ctx, group: str) -> list[tuple[str, str, str, Split]]:
    """(choice, input layout, output layout, split) that can run this group on this tensor size: what
    each registered strategy's table does to it (named after the first that does it), and st."""
    b, t = ctx.block, ctx.t
    if t == 1:
        return [("none", "R", "R", NONE)]
    din, douts = b.projections(group)
    heads = divides(t, b.heads, b.kv_heads)
    sizes = {"in": (din,), "out": douts, "rank": (b.rank,), "": ()}
    out, seen = [], set()
    for table in strategy_layers(b.factored, b.online_norm):
        split = table.splits[GROUPS.index(group)]
        if split is None or split in seen or (table.factored_only and not b.factored):
            continue
        seen.add(split)
        if not divides(t, *sizes[split.first], *(sizes[split.second] if b.factored else ())):
            continue
        if not heads and {"heads", "kv_heads"} & set(split.split_axes(group, b.factored)):
            continue
        out.append((table.name, *split.layouts(b.factored), split))
    n = ctx.n
    if n and (group not in ("qkv", "o") or heads) and divides(n, din, *douts, *((b.rank,) if b.factored else ())):
        out.append((ST, "H", "H", GRID))
    return out


def partial_input_grad(block: Block, split: Split) -> bool:
    """Whether the group's input gradient comes out partial (its input is replicated and the GEMM
    reading it split along its output): reduced by the edge in front of it (see `edge`). A factored
    group whose A is whole has a complete input gradient (its B's input gradient is reduced)."""
    return split.first == "rank" or (split.first == "out" and not block.factored)


def group_op(ctx: Ctx, group: str, split: Split, fused_norm: bool = False) -> Op:
    """The work of one projection group under one split (see the BOOST notes for the row- and
    column-parallel stages and the PrimePar notes for st). `fused_norm`: the norm in front is BTP's
    online RMSNorm (parallel/online_norm.py): its float32 statistics are all-reduced beside the A
    products, in an all-reduce of their own. Partial input gradients (partial_input_grad) are charged
    to the edge in front."""
    b, t, m = ctx.block, ctx.t, ctx.tokens
    din, douts = b.projections(group)
    g, r, dsum = len(douts), b.rank, sum(douts)
    op = Op(f"{group}:{split.first}/{split.second}")
    if split == GRID:  # every projection's GEMMs are P(n x n)s on the (fsdp, tensor) grid, one each
        n = ctx.n  # == t
        # Kept for the backward: each GEMM's skewed input and its output (and σ's input).
        if b.factored:
            op.st = [StMatmul(m, din, r, n, "A", shared=j > 0) for j in range(g)] + [
                StMatmul(m, r, o, n, "B") for o in douts
            ]
            op.acts, op.saved_lowrank = m * (g * din + 3 * g * r + dsum) / n, m * g * r / n
            op.grid_weights = (din * g * r + r * dsum) / n
        else:
            op.st = [StMatmul(m, din, o, n, "W", shared=j > 0) for j, o in enumerate(douts)]
            op.acts, op.grid_weights = m * (g * din + dsum) / n, din * dsum / n
        op.ring = sum(s.ring() for s in op.st)
        return _with_saved(op, ctx, False)
    first, second = split.first, split.second
    if not b.factored:  # one GEMM for the group: input features split (output partial), or output columns
        op.gemms = [Gemm(m, din / t if first == "in" else din, dsum / t if first == "out" else dsum, "W")]
        op.acts = m * dsum / t if first == "out" else m * dsum
        op.weights = din * dsum / t if first else din * dsum
        return _with_saved(op, ctx, False)
    fused = fused_norm and first == "in"
    stats = m if fused else 0
    gate = gate_in_gemm(ctx, group, split)
    op.gemms = [
        Gemm(
            m,
            din / t if first == "in" else din,
            g * r / t if first == "rank" else g * r,
            "A",
            gated=gate and group == "mlp_out",
        )
    ] + [Gemm(m, r / t if second == "rank" else r, o / t if second == "out" else o, "B") for o in douts]
    if first == "in" and second == "rank":  # the partial r-wide products land split over the rank
        op.colls = [
            Coll("reduce-scatter", m * g * r, t, 1, "fwd", saved=True),
            Coll("all-gather", m * g * r, t, 1, "bwd"),
        ]
    elif first == "in":  # the partial r-wide products all-reduced, the norm's float32 statistics beside
        # them in their own all-reduce (XLA combines no all-reduces of different dtypes)
        op.colls = [Coll("all-reduce", m * g * r, t, 1, "fwd", saved=True)]
        if fused:
            op.colls.append(Coll("all-reduce", m, t, 1, "fwd", saved=True, float32=True, beside_gemm=True))
    if second == "out" and first != "rank":  # B's input gradient is partial over its output columns
        op.colls.append(Coll("all-reduce", m * g * r, t, 1, "bwd"))
    r_kept = g * r / t if first == "rank" or second == "rank" else g * r  # A's output on this device
    # the gate and up outputs read by the gated down GEMM pass through no elementwise kernel: their loads
    # and stores are that GEMM's operand traffic (cost.gated_gemm_seconds)
    outputs = 0.0 if gate and group == "mlp_in" else dsum / (t if second == "out" else 1)
    # A's output and σ of it; σ inside the B GEMMs (their prologue, σ' in the input gradient's epilogue)
    # writes no σ(A·x) (kernels/gated_gemm.py `act_matmuls`)
    sigma = 0.0 if b.nonlinear and kernels_in_gemms(ctx)[1] else r_kept
    op.acts = m * (r_kept + sigma + outputs)
    op.saved_lowrank = m * r_kept + stats
    op.weights = din * g * r / (t if first else 1) + r * dsum / (t if second else 1)
    op.ring = 0
    return _with_saved(op, ctx, fused, group)


def gate_in_gemm(ctx: Ctx, group: str, split: Split) -> bool:
    """Whether this factored MLP group meets the gate product inside the down projection's first GEMM
    (operators.kernels_in_gemms): mlp_in's gate and up outputs feed it, mlp_out's A GEMM is it; where
    d_ff is whole on the device (mlp_in's B outputs, mlp_out's A input not split: cores.activation's
    fallback to the gate kernel otherwise)."""
    if group == "mlp_in":
        whole = split.second != "out"
    elif group == "mlp_out":
        whole = split.first != "in"
    else:
        return False
    return whole and kernels_in_gemms(ctx)[0]


def _with_saved(op: Op, ctx: Ctx, fused: bool, group: str = "") -> Op:
    """Set what a projection group keeps for the backward: arrays of its first stages' outputs (the
    B outputs are kept by their consumers: attention, the MLP core, the residual add keeps none)."""
    b, on_gpu = ctx.block, gpu(ctx)
    if b.factored:
        a_out = sum(g.m * g.n for g in op.gemms if g.tag == "A") + sum(s.m * s.out / s.n for s in op.st if s.tag == "A")
        kept = SAVED_SIGMA if b.nonlinear else SAVED_LINEAR
        op.bottleneck = a_out if b.nonlinear else 0.0
        if on_gpu:
            op.saved = a_out * kept
            op.saved32 = a_out * GPU_SAVED_ONLINE_NORM32 if fused else 0.0
            if fused:  # in memory: the scanned stack's float32 copies (kept_arrays.GPU_KEPT_ONLINE_NORM32)
                op.kept = (op.saved, a_out * GPU_KEPT_ONLINE_NORM32.get(group, GPU_SAVED_ONLINE_NORM32))
            op.kept_unrolled = (a_out * min(kept, GPU_UNROLLED_SIGMA), 0.0)
            if b.nonlinear and kernels_in_gemms(ctx)[1]:  # σ inside the B GEMMs: A's output alone
                op.kept = op.kept_unrolled = (a_out * GPU_SIGMA_IN_GEMM, op.saved32)
        else:
            op.saved = a_out * (kept + (SAVED_ONLINE_NORM if fused else 0))
    return op


_STORED: dict = {}


def stored_grid_axes(strategy: str, names: tuple[str, str], shape: tuple[int, int], n: int) -> tuple:
    """The mesh axes (fsdp / tensor / None) a strategy's rule table stores a weight's two dims over
    on an n x n (fsdp, tensor) grid (boost_jax.parallel.rules.spec_for on that table)."""
    key = (strategy, names, shape, n)
    if key not in _STORED:
        from boost_jax.parallel import strategies  # lazy: imports jax; memoised, off the DP's path
        from boost_jax.parallel.rules import spec_for  # lazy: imports jax; memoised, off the DP's path

        table = strategies.registered(strategy).rules
        mesh = types.SimpleNamespace(shape={"pipeline": 1, "data": 1, "fsdp": n, "tensor": n})
        spec = tuple(spec_for(names, shape, mesh, table))
        _STORED[key] = (spec + (None, None))[:2]
    return _STORED[key]


def st_stored(ctx: Ctx, group: str, strategy: str) -> tuple[list[Coll], float]:
    """What an st group costs beyond P(n x n) under `strategy`'s stored layouts: a weight stored
    whole along a grid axis (e.g. megatron's factored A of qkv/mlp_in, B of o/mlp_out: (fsdp, None)) is
    sliced locally for the skew, so its gradient comes back as a block of the replicated shard and
    is all-reduced over that axis, in the compute dtype (the weight is cast before it is skewed).
    Returns those all-reduces and the group's stored weight elements per device x n (the
    `grid_weights` convention: per tensor shard, before the fsdp split)."""
    b, n = ctx.block, ctx.n
    din, douts = b.projections(group)
    from boost_jax.model.transformer import PROJECTION_AXES  # lazy: imports jax; the model's axes of each group

    in_axis, out_axes = PROJECTION_AXES[group]
    weights = (
        [((in_axis, "rank"), (din, b.rank))] * len(douts)
        + [(("rank", o), (b.rank, w)) for o, w in zip(out_axes, douts)]
        if b.factored
        else [((in_axis, o), (din, w)) for o, w in zip(out_axes, douts)]
    )
    out, stored = [], 0.0
    for names, shape in weights:
        axes = stored_grid_axes(strategy, names, shape, n)
        local = shape[0] * shape[1] / n ** sum(a in ("fsdp", "tensor") for a in axes)
        stored += local * n
        for axis, stride in (("tensor", 1), ("fsdp", n)):
            if axis not in axes:
                out.append(Coll("all-reduce", local, n, stride, "bwd", "tensor" if axis == "tensor" else "data_fsdp"))
    return out, stored
