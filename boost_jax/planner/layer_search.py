"""One layer's partitioning, solved for one (tensor size, micro-batch, remat policy) by PrimePar's segmented
dynamic programme: the residual edges cut the block into two segments (norm -> qkv -> attention -> o ->
add, norm -> mlp_in -> act -> mlp_out -> add); inside a segment the DP state is the activation's layout
between operators and an edge between different layouts costs the redistribution. The `Pricer` memoises
the operators and their costs the DP asks for."""

from __future__ import annotations

import heapq

from boost_jax.config import PROJECTION_GROUPS
from boost_jax.planner import cost, projections
from boost_jax.planner.cluster import Cluster
from boost_jax.planner.cores import activation, attention
from boost_jax.planner.edges import edge, norm, residual_add
from boost_jax.planner.operators import Ctx, Op, layouts
from boost_jax.planner.plans import Layer, Options
from boost_jax.planner.projections import group_op, partial_input_grad

SEGMENTS = (("qkv", "attention", "o"), ("mlp_in", "act", "mlp_out"))
BUILDERS = {
    "edge": edge,
    "norm": norm,
    "group": group_op,
    "attention": attention,
    "act": activation,
    "add": residual_add,
}


class Pricer:
    """Operators and their costs for one context, memoised (the DP asks for the same ones often).
    `unrolled`: the layer stack runs unrolled (remat none; see `unrolled_cluster`)."""

    def __init__(self, ctx: Ctx, cluster: Cluster, policy: str, opts: Options, unrolled: bool = False):
        self.ctx, self.cluster, self.policy, self.opts = ctx, cluster, policy, opts
        self.unrolled = unrolled
        self._ops: dict = {}
        self._costs: dict = {}
        self.summaries: dict = {}  # layer -> its LayerSummary
        self.rests: dict = {}  # what rest_ops priced, by its key
        self.bounds: dict = {}  # (layer, micro-batches, stage remat) -> what lower_bound reads
        self.layers: list | None = None

    def op(self, key) -> Op | None:
        """key = (kind, *arguments of its BUILDERS function)."""
        if key not in self._ops:
            self._ops[key] = BUILDERS[key[0]](self.ctx, *key[1:])
        return self._ops[key]

    def cost(self, key) -> cost.Cost:
        if key not in self._costs:
            self._costs[key] = cost.price(
                self.op(key), self.cluster, self.policy, self.ctx.attention, self.opts.act_bytes
            )
        return self._costs[key]

    def seconds(self, keys) -> float:
        return sum(self.cost(k).total for k in keys)


class Stages:
    """The operator keys of one segment's three DP stages, entered and left in `residual`:
    first(g) = edge in, norm, first group; core(src, layout) = edge, attention/act;
    last(core, g) = edge, last group, edge back to the residual, residual add."""

    def __init__(self, pr: Pricer, seg, residual: str):
        b = self.block = pr.ctx.block
        self.seg, self.residual, self.d = seg, residual, b.d
        self.w1, self.w2 = sum(b.projections(seg[0])[1]), b.projections(seg[2])[0]
        self.layer_output = seg == SEGMENTS[-1]  # the layer's last edge is never recomputed

    def first(self, g) -> list:
        """g: a choice of projections.group_choices (name, input layout, output layout, split)."""
        partial = partial_input_grad(self.block, g[3])
        if self.residual == "S" and g[1] != "S":  # sequence parallelism: normalise the token shard, then gather
            return [
                ("norm", "S", False),
                ("edge", "S", g[1], self.d, partial, False, True),
                ("group", self.seg[0], g[3], False),
            ]
        fused = g[3].fused  # the strategy's online RMSNorm: the statistics ride in A's all-reduce
        return [
            ("edge", self.residual, g[1], self.d, partial, False),
            ("norm", g[1], fused),
            ("group", self.seg[0], g[3], fused),
        ]

    def core(self, src: str, layout: str) -> list:
        return [("edge", src, layout, self.w1, False, False), (self.seg[1], layout)]

    def last(self, core: str, g) -> list:
        return [
            ("edge", core, g[1], self.w2, partial_input_grad(self.block, g[3]), False),
            ("group", self.seg[2], g[3], False),
            ("edge", g[2], self.residual, self.d, False, self.layer_output),
            ("add", self.residual),
        ]


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


def layer_keys(pr: Pricer, layer: Layer) -> list:
    """The operator keys of a whole layer, in order."""
    choice = dict(zip(PROJECTION_GROUPS, layer.choices))
    keys = []
    for seg, core in zip(SEGMENTS, (layer.attention, layer.act)):
        first, last = ({c[0]: c for c in group_choices(pr.ctx, g)}[choice[g]] for g in (seg[0], seg[2]))
        st = Stages(pr, seg, layer.residual)
        keys += st.first(first) + st.core(first[2], core) + st.last(core, last)
    return keys


_CHOICES: dict = {}  # group_choices' answers within one search (cleared when a search or plan_for starts)


def forget_choices() -> None:
    """Clear group_choices' memo (a search or plan_for starts)."""
    _CHOICES.clear()


def group_choices(ctx: Ctx, group: str) -> list:
    """projections.group_choices, memoised within one search (it depends on the block, the tensor size
    and the st grid's side)."""
    key = (ctx.block, ctx.t, ctx.n, group)
    if key not in _CHOICES:
        _CHOICES[key] = projections.group_choices(ctx, group)
    return _CHOICES[key]
