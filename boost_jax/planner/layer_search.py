"""One layer's partitioning, solved for one (tensor size, micro-batch, remat policy) by PrimePar's segmented
dynamic programme: the residual edges cut the block into two segments (norm -> qkv -> attention -> o ->
add, norm -> mlp_in -> act -> mlp_out -> add); inside a segment the DP state is the activation's layout
between operators and an edge between different layouts costs the redistribution. The operators and
their costs come from a `Pricer` (pricer.py), which memoises them."""

from __future__ import annotations

import heapq

from boost_jax.planner.ops.operators import layouts
from boost_jax.planner.pricing.plans import Layer
from boost_jax.planner.pricing.pricer import SEGMENTS, Pricer, Stages, group_choices


def solve_segment(pr: Pricer, seg, residual: str, k: int) -> list[tuple[float, tuple]]:
    """k best (seconds, (first choice, core layout, last choice)) for a segment entered and left in
    `residual`: a DP over the activation's layout between the operators."""
    st = Stages(pr, seg, residual)
    firsts, lasts = group_choices(pr.ctx, seg[0]), group_choices(pr.ctx, seg[2])
    state: dict[str, list] = {}
    for first in firsts:  # stage 1 -> state = the first group's output layout
        state.setdefault(first[2], []).append((pr.seconds(st.first(first)), (first,)))
    cores: dict[str, list] = {}
    for lay, paths in state.items():  # stage 2 -> state = the core's layout
        paths = heapq.nsmallest(k, paths)
        for core in layouts(pr.ctx):
            if pr.op((seg[1], core)) is None:
                continue
            s = pr.seconds(st.core(lay, core))
            cores.setdefault(core, []).extend((t + s, path + (core,)) for t, path in paths)
    done = []
    for core, paths in cores.items():  # stage 3 -> back in the residual layout
        paths = heapq.nsmallest(k, paths)
        for last in lasts:
            s = pr.seconds(st.last(core, last))
            done.extend((t + s, path + (last,)) for t, path in paths)
    return heapq.nsmallest(k, done)


def best_layers(pr: Pricer, k: int) -> list[Layer]:
    """The k fastest layer partitionings over every residual layout (memoised on the pricer)."""
    if pr.layers is None:
        found = []
        for residual in layouts(pr.ctx):
            attn, mlp = (solve_segment(pr, seg, residual, k) for seg in SEGMENTS)
            for ta, (qkv, lay_a, o) in attn:
                for tm, (gu, lay_m, down) in mlp:
                    found.append((ta + tm, Layer(residual, (qkv[0], o[0], gu[0], down[0]), lay_a, lay_m)))
        pr.layers = [layer for _, layer in heapq.nsmallest(k, found, key=lambda x: x[0])]
    return pr.layers
