"""A whole plan priced: its step time, memory, link bytes and the trainer's overrides (`price_plan`,
`trainer_overrides`), and the cheap lower bound on its step time the search prunes with (`lower_bound`)."""

from __future__ import annotations

from boost_jax.config import ST
from boost_jax.parallel.pipeline.arithmetic import bubble_fraction
from boost_jax.planner.pricing import cost
from boost_jax.planner.pricing.layer_summary import layer_summary, rest_ops, stage_forward
from boost_jax.planner.pricing.memory import memory_bytes
from boost_jax.planner.pricing.plans import Layer, Mesh, Plan
from boost_jax.planner.pricing.pricer import Pricer
from boost_jax.planner.pricing.schedule import Schedule, schedule_of
from boost_jax.planner.pricing.step_terms import (
    f1b_tick_seconds,
    link_bytes_per_step,
    parameters_per_device,
    step_collectives,
    step_seconds,
    tick_weight_seconds,
)
from boost_jax.planner.pricing.trainer_flags import linear_partition, runnable


def price_plan(
    pr: Pricer,
    mesh: Mesh,
    grad_accum: int,
    layer: Layer,
    flops_per_token: float,
    microbatches: int = 1,
    schedule: str = "gpipe",
    repeats: int = 1,
    stage_remat: str = "none",
) -> Plan:
    """Price a whole plan: L identical layers (pipelined: V M + S - 1 ticks of L/(S V) layers per
    stage, V = 1 for GPipe; `stage_remat` "stage" re-runs each stage's forward in the backward),
    embedding and head, data/fsdp traffic, stage hand-overs, optimizer: its time (`step_seconds`),
    memory (`memory_bytes`), link bytes and the trainer's overrides."""
    ctx, block = pr.ctx, pr.ctx.block
    summary = layer_summary(pr, layer)
    sched = schedule_of(block.layers, mesh.pipeline, microbatches, schedule, repeats, stage_remat)
    if sched.staged:
        stage_forward(pr, summary)
    rest, rest_cost = rest_ops(pr, layer.residual, sched.microbatches, sched.stages, sched.f1b)
    rest_fsdp_weights = sum(op.weights for op in rest) - block.d  # the final norm is not fsdp-sharded
    colls = step_collectives(pr, mesh, grad_accum, layer, summary, sched, rest, rest_fsdp_weights)
    params = parameters_per_device(mesh, summary, sched, rest_fsdp_weights, block.d)
    ticks_s = f1b_tick_seconds(pr, mesh, summary, sched, rest[0].weights + rest[1].weights)
    ticks_s += tick_weight_seconds(pr, summary, sched, mesh.fsdp)  # GPipe / circular (0 for 1F1B)
    step_s, exposed, optimizer_s = step_seconds(pr, grad_accum, summary, sched, colls, rest_cost, params, ticks_s)
    memory = memory_bytes(pr, mesh, grad_accum, layer, summary, sched, params, rest_fsdp_weights)
    links = link_bytes_per_step(pr, grad_accum, summary, sched, colls)
    status, strategy, sp, flags = trainer_overrides(pr, mesh, grad_accum, layer, sched)
    tokens = pr.opts.batch * pr.opts.seq
    return Plan(
        mesh=mesh,
        grad_accum=grad_accum,
        remat=pr.policy,
        layer=layer,
        step_s=step_s,
        tokens_per_s=tokens / step_s,
        mfu=flops_per_token * tokens / (step_s * mesh.devices * pr.cluster.peak_flops),
        memory=memory,
        link_bytes=links,
        layer_cost=summary.cost,
        rest_cost=rest_cost,
        exposed_dp_s=exposed,
        optimizer_s=optimizer_s,
        layer_colls=summary.tensor_colls + colls.data_once + colls.data,
        redo_colls=summary.recomputed,
        rest_colls=[c for c, _ in colls.rest] + colls.data_rest,
        tokens=ctx.tokens,
        runnable=status,
        strategy=strategy,
        sequence_parallel=sp,
        overrides=flags,
        microbatches=sched.microbatches,
        bubble=bubble_fraction(sched.stages, sched.microbatches, sched.repeats),
        shift_s=colls.shift_seconds,
        pipeline_colls=colls.shift,
        step_colls=[(c, sched.executed) for c in summary.tensor_colls + summary.recomputed] + colls.counted,
        schedule=sched.name,
        repeats=sched.repeats,
        stage_remat=sched.stage_remat,
        context_attention=ctx.context_attention if mesh.context > 1 else "",
        context_kv=ctx.context_kv if mesh.context > 1 else "",
        unrolled=pr.unrolled,
    )


def lower_bound(
    pr: Pricer,
    mesh: Mesh,
    grad_accum: int,
    layer: Layer,
    microbatches: int = 1,
    schedule: str = "gpipe",
    repeats: int = 1,
    stage_remat: str = "none",
) -> float:
    """A lower bound on price_plan(...).step_s, cheap to compute: the same layer passes, embedding,
    head and optimizer, without the stage hand-overs and the exposed data/fsdp traffic (both >= 0)."""
    b = pr.ctx.block
    stages = mesh.pipeline
    m = microbatches if stages > 1 else 1
    if stages == 1 or schedule == "gpipe":
        repeats = 1
    staged = stages > 1 and stage_remat == "stage"
    f1b = stages > 1 and schedule == "1f1b"
    key = (layer, m, staged, f1b)
    if key not in pr.bounds:
        s = layer_summary(pr, layer)
        rest, rest_cost = rest_ops(pr, layer.residual, m, 1, f1b)  # the head's gradient over tensor only
        pr.bounds[key] = (
            s.cost.total + (stage_forward(pr, s).forward if staged else 0.0),
            s.fsdp_w + s.grid_w,
            s.norm_w,
            rest_cost.total,
            sum(op.weights for op in rest) - b.d,
        )
    layer_s, sharded_w, norm_w, rest_s, rest_fsdp_w = pr.bounds[key]
    per_stage = b.layers // stages
    runs = cost.pipeline_ticks(stages, m, repeats) * (per_stage // repeats)
    params = per_stage * (sharded_w / mesh.fsdp + norm_w) + rest_fsdp_w / mesh.fsdp + b.d
    return grad_accum * (runs * layer_s + rest_s) + params * cost.OPTIMIZER_TRAFFIC / pr.cluster.hbm_bandwidth


def trainer_overrides(
    pr: Pricer, mesh: Mesh, grad_accum: int, layer: Layer, sched: Schedule
) -> tuple[str, str, bool, str]:
    """(runnable status, strategy, sequence_parallel, the trainer's --config overrides that run the plan)."""
    ctx, opts, block, stages = pr.ctx, pr.opts, pr.ctx.block, sched.stages
    status, strategy, sp = runnable(block, mesh, layer)
    from boost_jax.parallel.strategies import registered  # lazy: imports jax; not at the planner's import

    if status == "yes" and ctx.context_kv == "bottleneck" and not registered(strategy).keeps_whole_rank:
        status, strategy, sp = (
            (
                f"no: context_kv=bottleneck rebuilds K/V from the whole r-wide activations, which "
                f"{strategy} splits over tensor"
            ),
            "",
            False,
        )
    context = ""
    if mesh.context > 1:
        context = (
            f"--config.parallel.context={mesh.context} --config.parallel.context_attention="
            f"{ctx.context_attention} --config.parallel.context_kv={ctx.context_kv} "
        )
    flags = ""
    if status == "yes":
        flags = (
            (
                f"--config.parallel.pipeline={stages} --config.parallel.microbatches={sched.microbatches} "
                if stages > 1
                else ""
            )
            + (
                f"--config.parallel.pipeline_schedule=circular --config.parallel.pipeline_repeats={sched.repeats} "
                if sched.name == "circular"
                else ""
            )
            + ("--config.parallel.pipeline_schedule=1f1b " if sched.f1b else "")
            + (f"--config.parallel.pipeline_repeats={sched.repeats} " if sched.f1b and sched.repeats > 1 else "")
            + f"--config.parallel.data={mesh.data} --config.parallel.fsdp={mesh.fsdp} "
            + context
            + f"--config.parallel.tensor={mesh.tensor} --config.parallel.strategy={strategy} "
            + ("--config.parallel.sequence_parallel=true " if sp else "")
            + (f"--config.parallel.linear_partition={linear_partition(layer)} " if ST in layer.choices else "")
            + (f"--config.model.attention={opts.attention} " if opts.attention != "auto" else "")
            + f"--config.train.global_batch={opts.batch} --config.train.grad_accum={grad_accum} "
            f"--config.train.seq_len={opts.seq} "
            + (f"--config.model.max_seq_len={opts.seq} " if opts.seq > block.max_seq_len else "")
            + f"--config.remat.policy={pr.policy} --config.model.scan_unroll={str(pr.unrolled).lower()}"
            + (" --config.remat.pipeline=stage" if sched.staged else "")
        )
    return status, strategy, sp, flags
