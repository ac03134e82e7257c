"""One pricing context (tensor size, micro-batch, remat policy): the operator keys a layer partitioning
is made of (`Stages`, `layer_keys`), the operators and their costs memoised (`Pricer`), the partition
choices per projection group (`group_choices`, memoised) and what a plan needs of one layer
partitioning (`LayerSummary`)."""

from __future__ import annotations

import dataclasses

from boost_jax.config import PROJECTION_GROUPS
from boost_jax.planner.ops import projections
from boost_jax.planner.ops.cores import activation, attention
from boost_jax.planner.ops.edges import edge, norm, residual_add
from boost_jax.planner.ops.operators import Ctx, Op
from boost_jax.planner.ops.projections import group_op, partial_input_grad
from boost_jax.planner.pricing import cost
from boost_jax.planner.pricing.cluster import Cluster
from boost_jax.planner.pricing.plans import Cost, Layer, Options

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

    def cost(self, key) -> Cost:
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


@dataclasses.dataclass
class LayerSummary:
    """What a plan needs of one layer partitioning on one pricer (mesh-independent, memoised)."""

    ops: list
    cost: Cost  # one layer, one micro-batch
    norm_w: float  # norm weights (not fsdp-sharded)
    fsdp_w: float  # the rest of the layer's weights on one tensor shard but st's
    grid_w: float  # st's weights on one tensor shard (fsdp-split, never gathered)
    tensor_colls: list  # tensor-axis collectives, forward + backward
    recomputed: list  # forward collectives the remat policy re-runs
    saved: float  # activation bytes kept for the backward (the remat policy's, plus its carry)
    working: float  # one layer's recomputed activations during its backward under remat
    tensor_links: dict  # bytes on each link: intra / inter (tensor + recomputed collectives)
    kept_none: float  # activation bytes the layer keeps without remat (its recompute under stage remat)
    bottleneck: float = 0.0  # σ(A·x) A output elements the layer keeps (see cost.PIPELINED_SIGMA)
    matrices: int = 1  # weight matrices whose gradient is reduced over data/fsdp (one einsum each)
    # bytes of `saved` the unpipelined GPU program gathers again instead of keeping (Op.kept: the
    # sequence-parallel gathers' outputs), which a pipelined plan keeps (memory.memory_bytes)
    regathered: float = 0.0
    # seconds of the layer's forward alone (what remat.pipeline=stage re-runs) and the collectives it
    # runs (tensor axis; st's permutes): priced on first use (stage_forward)
    forward: float | None = None
    forward_colls: list | None = None
