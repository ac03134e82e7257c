"""What a plan needs of one layer partitioning on one pricer (mesh-independent, memoised): its operators,
cost, weights, collectives and kept activations; the stage's forward re-run; the embedding and head."""

from __future__ import annotations

import dataclasses

from boost_jax.config import PROJECTION_GROUPS, ST
from boost_jax.planner.ops.operators import Op
from boost_jax.planner.ops.outside_stack import embedding, head
from boost_jax.planner.ops.projections import st_stored
from boost_jax.planner.pricing import cost
from boost_jax.planner.pricing.plans import Cost, Layer, Mesh
from boost_jax.planner.pricing.pricer import LayerSummary, Pricer, layer_keys
from boost_jax.planner.pricing.trainer_flags import runnable


def layer_summary(pr: Pricer, layer: Layer) -> LayerSummary:
    if layer not in pr.summaries:
        ctx, cl, opts, policy = pr.ctx, pr.cluster, pr.opts, pr.policy
        keys = layer_keys(pr, layer)
        ops = [pr.op(k) for k in keys]
        _, strategy, _ = runnable(ctx.block, Mesh(1, 1, ctx.t), layer)
        stored = [
            st_stored(ctx, g, strategy)
            for g, choice in zip(PROJECTION_GROUPS, layer.choices)
            if choice == ST and strategy
        ]
        extra = [c for colls, _ in stored for c in colls]
        grid_w = sum(w for _, w in stored) if stored else sum(op.grid_weights for op in ops)
        if extra:  # the strategy's stored layouts cost the st groups more than P(n x n) (see there)
            ops.append(Op(f"st weights@{strategy}", colls=extra, recompute=False))
        norm_w = sum(op.weights for op in ops if op.name.startswith("norm"))
        tensor_colls = [c for op in ops for c in op.all_colls()]
        # forward collectives the remat policy re-runs: the operators' own and the st matmuls'
        # (st_seconds already counts their time; see st_recomputed)
        recomputed = [c for op in ops for c in cost.recomputed(op, policy)[3] + cost.st_recomputed(op, policy)]
        carry = ctx.local(layer.residual, ctx.block.d) * opts.act_bytes if policy != "none" else 0.0
        links = {"intra": 0.0, "inter": 0.0}
        for c in tensor_colls + recomputed:
            links["inter" if cl.spans_nodes(c.stride, c.size) else "intra"] += cost.link_bytes(
                c.kind, cost.coll_bytes(c, opts.act_bytes), c.size
            )
        pr.summaries[layer] = LayerSummary(
            ops=ops,
            cost=sum((pr.cost(k) for k in keys), Cost())
            + sum((cost.price(op, cl, "none", ctx.attention, opts.act_bytes) for op in ops[len(keys) :]), Cost())
            + Cost(kept=cl.kept_passes * carry / cl.hbm_bandwidth),  # the layer input a remat policy keeps
            norm_w=norm_w,
            fsdp_w=sum(op.weights for op in ops) - norm_w,
            grid_w=grid_w,
            tensor_colls=tensor_colls,
            recomputed=recomputed,
            saved=sum(cost.kept_bytes(op, policy, opts.act_bytes, pr.unrolled) for op in ops) + carry,
            working=cost.backward_working(ops, policy, opts.act_bytes, pr.unrolled),
            tensor_links=links,
            kept_none=sum(cost.kept_bytes(op, "none", opts.act_bytes, pr.unrolled) for op in ops),
            bottleneck=sum(op.bottleneck for op in ops),
            # one einsum per stage of a group (a group's projections share it: grouped linears)
            matrices=max(1, sum(len({g.tag for g in op.gemms}) for op in ops if op.weights)),
            regathered=sum(
                cost.saved_bytes(op, policy, opts.act_bytes) - cost.kept_bytes(op, policy, opts.act_bytes)
                for op in ops
                if op.kept is not None and "->" in op.name  # the edges' (sequence-parallel gathers')
            ),
        )
    return pr.summaries[layer]


def stage_forward(pr: Pricer, s: LayerSummary) -> LayerSummary:
    """`s` with its forward and forward_colls: remat.pipeline=stage re-runs the whole forward of the
    stage (every operator, the layer's output edge included) before its backward, whatever the layer
    policy keeps inside. Priced once, where a plan needs it."""
    if s.forward is None:
        whole = [dataclasses.replace(op, recompute=True) for op in s.ops]
        s.forward = sum(
            cost.price(op, pr.cluster, "full", pr.ctx.attention, pr.opts.act_bytes).recompute for op in whole
        )
        s.forward_colls = [c for op in whole for c in cost.recomputed(op, "full")[3] + cost.st_recomputed(op, "full")]
    return s


def rest_ops(pr: Pricer, residual: str, microbatches: int, stages: int = 1, f1b: bool = False) -> tuple[list, Cost]:
    """Embedding, head and loss (and their cost) of one accumulation micro-batch: outside the
    pipeline they run on all its rows, on every stage. A GPipe or circular pipeline (`stages` > 1)
    sums the head's input gradient over its stages too, 1F1B (`f1b`) runs the head and loss per
    micro-batch (outside_stack.head's `grad_ways`, `per_item`)."""
    key = (residual, microbatches, stages, f1b)
    if key not in pr.rests:
        ctx = pr.ctx if microbatches == 1 else dataclasses.replace(pr.ctx, tokens=pr.ctx.tokens * microbatches)
        rest = [embedding(ctx, residual), head(ctx, residual, microbatches, 1 if f1b else stages, f1b)]
        pr.rests[key] = (
            rest,
            sum((cost.price(op, pr.cluster, "none", pr.ctx.attention, pr.opts.act_bytes) for op in rest), Cost()),
        )
    return pr.rests[key]
