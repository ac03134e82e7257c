"""The plan search (`search`) and the pricing of one given plan (`plan_for`).

For every mesh pipeline x data x fsdp x context x tensor of the device count, every pipeline
micro-batch count and schedule, every gradient-accumulation count that splits the batch evenly and
every remat policy (search_space.py), one transformer layer is solved by PrimePar's segmented dynamic
programme (layer_search.py), which keeps the `keep` best paths per layout; identical layers are
combined by multiplying by L (L/S per stage, times the schedule's ticks). The non-additive parts
(data/fsdp traffic hidden behind the micro-batch, memory) are priced afterwards on that short list
(pricing/whole_plan.py) and plans over the usable HBM are rejected. Every plan gets a cheap lower
bound first; only those whose bound can enter the result are priced in full (see `search`).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time

from boost_jax.config import PROJECTION_GROUPS
from boost_jax.planner.layer_search import best_layers
from boost_jax.planner.ops.operators import Block, Ctx
from boost_jax.planner.pricing import cost
from boost_jax.planner.pricing.cluster import Cluster
from boost_jax.planner.pricing.plans import Layer, Mesh, Options, Plan, Result
from boost_jax.planner.pricing.pricer import Pricer, forget_choices, group_choices
from boost_jax.planner.pricing.trainer_flags import forget_runnable, runnable
from boost_jax.planner.pricing.whole_plan import lower_bound, price_plan
from boost_jax.planner.search_space import (
    check_pipeline,
    context_modes,
    context_sizes,
    divisors,
    meshes,
    microbatch_counts,
    pipeline_variants,
    policies,
    stacks,
    stage_counts,
    unrolled_cluster,
)


def model_flops_per_token(cfg, seq: int) -> float:
    from boost_jax.model.transformer import flops_per_token  # lazy: imports jax; keep it off the search path

    return flops_per_token(cfg.model, seq, training=True)


def plan_attention(opts: Options, block: Block, context: int) -> str:
    """The attention cost class a plan at this context size runs: opts.attention's
    (cost.attention_kind), under context as it runs there (model/attention/registry.py under_context)."""
    from boost_jax.model.attention import under_context  # lazy: imports jax; once per search

    return cost.attention_kind(
        under_context(opts.attention) if context > 1 else opts.attention, block, opts.seq, opts.act_bytes
    )


def plan_for(
    cfg,
    cluster: Cluster,
    mesh: Mesh,
    grad_accum: int,
    remat: str,
    layer: Layer,
    opts: Options,
    flops_per_token: float | None = None,
    microbatches: int = 0,
    schedule: str = "gpipe",
    repeats: int = 1,
    stage_remat: str = "none",
    context_attention: str = "ring",
    context_kv: str = "full",
    unrolled: bool = False,
) -> Plan:
    """Price one given plan (no search), e.g. a trainer strategy: see strategy_tables.uniform_plan.
    `microbatches`: micro-batches per pass when mesh.pipeline > 1 (0: the trainer's 2S); `schedule`,
    `repeats`, `stage_remat`: parallel.pipeline_schedule, parallel.pipeline_repeats, remat.pipeline;
    `context_attention`, `context_kv`: parallel.context_attention / context_kv when mesh.context > 1;
    `unrolled`: model.scan_unroll=true (remat none; priced as the search prices it, `stacks`)."""
    block = Block.from_config(cfg)
    opts = dataclasses.replace(
        opts,
        pipelined=cost.pipeliner(opts.pipelined),  # read once, not per plan
        double_buffered=cost.double_buffering(opts.double_buffered),
    )
    forget_runnable()
    forget_choices()
    stages = mesh.pipeline
    m = (microbatches or 2 * stages) if stages > 1 else 1
    if block.layers % stages:
        raise ValueError(f"{stages} pipeline stages do not divide the model's {block.layers} layers")
    check_pipeline(block.layers, stages, m, schedule, repeats, stage_remat)
    context_sizes(mesh.devices, opts.seq, dataclasses.replace(opts, context=(mesh.context,)), opts.attention)
    if (context_attention, context_kv) not in context_modes(
        block, mesh.context, dataclasses.replace(opts, context_attention=(context_attention,), context_kv=(context_kv,))
    ) and mesh.context > 1:
        raise ValueError(
            f"--context-kv: bottleneck passes the r-wide activations of a factored kind; "
            f"model.linear={cfg.model.linear} has none"
        )
    micro = opts.batch // grad_accum // (mesh.data * mesh.fsdp * m)
    if micro * grad_accum * mesh.data * mesh.fsdp * m != opts.batch:
        raise ValueError(
            f"--batch {opts.batch} does not split into {grad_accum} micro-batches of {m} pipeline "
            f"micro-batches over data x fsdp = {mesh.data * mesh.fsdp}"
        )
    kind = plan_attention(opts, block, mesh.context)
    pr = Pricer(
        Ctx(
            block,
            mesh.tensor,
            micro * opts.seq // mesh.context,
            opts.seq,
            mesh.fsdp == mesh.tensor and mesh.context == 1,
            kind,
            opts.act_bytes,
            mesh.context,
            context_attention,
            context_kv,
            mesh.devices,
        ),
        unrolled_cluster(cluster) if unrolled else cluster,
        remat,
        opts,
        unrolled,
    )
    fpt = flops_per_token if flops_per_token is not None else model_flops_per_token(cfg, opts.seq)
    return price_plan(pr, mesh, grad_accum, layer, fpt, m, schedule, repeats, stage_remat)


def search(cfg, cluster: Cluster, devices: int, opts: Options, flops_per_token: float | None = None) -> Result:
    """The top plans for `devices` GPUs of `cluster` training `cfg` at opts.batch x opts.seq.

    Every plan of the space gets a lower bound on its step time first (`lower_bound`: its layers,
    embedding, head and optimizer, without the stage hand-overs and exposed data/fsdp traffic that
    only add); plans are then priced in full in the order of their bounds, and a plan whose bound
    exceeds both the opts.top-th best distinct plan found so far and (for a plan the trainer runs)
    the best runnable one cannot enter the result, so it is not priced (opts.prune; False prices
    every plan). The result is the same either way; `smallest` is the least memory among the plans
    priced, which is every plan when none fits (the case it explains)."""
    block = Block.from_config(cfg)
    opts = dataclasses.replace(
        opts,
        pipelined=cost.pipeliner(opts.pipelined),  # read once, not per plan
        double_buffered=cost.double_buffering(opts.double_buffered),
    )
    fpt = flops_per_token if flops_per_token is not None else model_flops_per_token(cfg, opts.seq)
    contexts = context_sizes(devices, opts.seq, opts, opts.attention)
    kinds = {c: plan_attention(opts, block, c) for c in contexts}
    start = time.perf_counter()
    forget_runnable()
    forget_choices()
    candidates = plan_candidates(cfg, block, cluster, devices, opts, contexts, kinds)
    if opts.prune:
        candidates.sort(key=lambda c: (c[0], c[1]))
    plans, priced, rejected, smallest = price_candidates(candidates, block, cluster, opts, fpt)
    # Ties (data/fsdp-bound plans) go to what the trainer runs, then to the faster compute path, then to
    # the search order.
    plans = [
        p for p, _ in sorted(plans, key=lambda x: (x[0].step_s, x[0].runnable != "yes", x[0].layer_cost.total, x[1]))
    ]
    top, seen = [], set()
    for p in plans:  # distinct partitionings (and context modes), each at its best micro-batching and remat
        if (p.mesh, p.layer, p.context_attention, p.context_kv) not in seen:
            seen.add((p.mesh, p.layer, p.context_attention, p.context_kv))
            top.append(p)
        if len(top) == opts.top:
            break
    best_runnable = next((p for p in plans if p.runnable == "yes"), None)
    return Result(top, best_runnable, len(candidates), rejected, time.perf_counter() - start, smallest, priced)


def plan_candidates(
    cfg, block: Block, cluster: Cluster, devices: int, opts: Options, contexts: list, kinds: dict
) -> list:
    """Every plan of the space, in search order, as (lower bound (0 without opts.prune), index, pricer,
    mesh, accum, layer, micro, schedule, repeats, stage remat); `kinds`: the attention cost class per
    context size."""
    pricers: dict = {}
    candidates = []
    for mesh in meshes(devices, stage_counts(devices, block.layers, opts), contexts):
        ways = mesh.data * mesh.fsdp
        grid = mesh.fsdp == mesh.tensor and mesh.context == 1
        kind = kinds[mesh.context]
        if any(not group_choices(Ctx(block, mesh.tensor, opts.seq, opts.seq, grid), g) for g in PROJECTION_GROUPS):
            continue  # no choice splits some group over this tensor size
        accums = [opts.grad_accum] if opts.grad_accum else divisors(opts.batch)
        for accum in accums:
            if opts.batch % accum or (opts.batch // accum) % ways:
                continue
            rows = opts.batch // accum // ways
            if mesh.context > 1 and 1 in contexts and rows % mesh.context == 0:
                continue  # dominated: the mesh with C folded into data runs as many tokens per device unexchanged
            for micro in microbatch_counts(mesh.pipeline, rows, opts):
                tokens = rows // micro * opts.seq // mesh.context
                for policy, (attention, kv), unrolled in [
                    (p, a, u)
                    for p in policies(block, opts)
                    for a in context_modes(block, mesh.context, opts)
                    for u in stacks(mesh, p, opts)
                ]:
                    key = (mesh.tensor, tokens, policy, grid, mesh.context, attention, kv, unrolled)
                    if key not in pricers:
                        ctx = Ctx(
                            block,
                            mesh.tensor,
                            tokens,
                            opts.seq,
                            grid,
                            kind,
                            opts.act_bytes,
                            mesh.context,
                            attention,
                            kv,
                            devices,
                        )
                        on = unrolled_cluster(cluster) if unrolled else cluster
                        pricers[key] = Pricer(ctx, on, policy, opts, unrolled)
                    pr = pricers[key]
                    for layer in best_layers(pr, opts.keep):
                        for schedule, repeats, staged in pipeline_variants(block.layers, mesh.pipeline, micro, opts):
                            bound = (
                                lower_bound(pr, mesh, accum, layer, micro, schedule, repeats, staged)
                                if opts.prune
                                else 0.0
                            )
                            candidates.append(
                                (bound, len(candidates), pr, mesh, accum, layer, micro, schedule, repeats, staged)
                            )
    return candidates


def price_candidates(candidates: list, block: Block, cluster: Cluster, opts: Options, fpt: float):
    """Price the candidates in order, stopping (opts.prune) where no later bound can enter the result:
    ([(plan that fits, index)], plans priced, plans over the usable HBM, the smallest plan priced)."""
    plans, priced, rejected, smallest = [], 0, 0, None
    best: dict = {}  # distinct partitioning -> its fastest fitting plan's step
    kth = best_runnable_s = math.inf  # the opts.top-th distinct step; the fastest runnable step
    for bound, index, pr, mesh, accum, layer, micro, schedule, repeats, staged in candidates:
        if opts.prune and bound * (1 - 1e-9) > kth:
            if bound * (1 - 1e-9) > best_runnable_s:
                break  # sorted by bound: no later plan can enter the result either
            if runnable(block, mesh, layer)[0] != "yes":
                continue  # it can only be the best runnable plan, and it is not runnable
        plan = price_plan(pr, mesh, accum, layer, fpt, micro, schedule, repeats, staged)
        priced += 1
        if plan.overrides and plan.overrides in opts.exclude:
            continue  # compiled, it did not fit (parallel.plan=auto's fallback)
        if smallest is None or plan.memory["total"] < smallest.memory["total"]:
            smallest = plan
        if opts.check_memory and plan.memory["total"] > cluster.usable_hbm:
            rejected += 1
            continue
        plans.append((plan, index))
        if plan.runnable == "yes":
            best_runnable_s = min(best_runnable_s, plan.step_s)
        distinct = (plan.mesh, plan.layer, plan.context_attention, plan.context_kv)
        if plan.step_s < best.get(distinct, math.inf):
            best[distinct] = plan.step_s
            if plan.step_s < kth and len(best) >= opts.top:
                kth = heapq.nsmallest(opts.top, best.values())[-1]
    return plans, priced, rejected, smallest
