"""Whether the trainer runs a plan (one of its strategies' rule tables, st groups as
parallel.linear_partition) and the --config overrides that run it."""

from __future__ import annotations

from boost_jax.config import PROJECTION_GROUPS, ST
from boost_jax.planner.layer_search import Pricer
from boost_jax.planner.operators import Block
from boost_jax.planner.plans import Layer, Mesh
from boost_jax.planner.schedule import Schedule
from boost_jax.planner.strategy_tables import choice_names, strategy_layers


def linear_partition(layer: Layer) -> str:
    """`parallel.linear_partition` for the layer's st groups ("" when none)."""
    groups = [g for g, c in zip(PROJECTION_GROUPS, layer.choices) if c == ST]
    return ST if len(groups) == len(PROJECTION_GROUPS) else ",".join(f"{g}={ST}" for g in groups)


_RUNNABLE: dict = {}  # runnable's answers within one search (cleared when a search or plan_for starts)


def forget_runnable() -> None:
    """Clear runnable's memo (a search or plan_for starts)."""
    _RUNNABLE.clear()


def runnable(block: Block, mesh: Mesh, layer: Layer) -> tuple[str, str, bool]:
    """("yes", strategy, sequence_parallel) if the trainer runs this layer as one of its strategies
    (their rule tables, read by strategy_layers) with its st groups spatial-temporal
    (parallel.linear_partition), else ("no: why", "", False). On one tensor shard every strategy runs
    alike: the first registered one the model's kind takes."""
    key = (block.factored, block.online_norm, mesh.tensor == 1, layer)
    if key not in _RUNNABLE:
        _RUNNABLE[key] = _runnable(block, mesh, layer)
    return _RUNNABLE[key]


def _runnable(block: Block, mesh: Mesh, layer: Layer) -> tuple[str, str, bool]:
    tables = [t for t in strategy_layers(block.factored, block.online_norm) if block.factored or not t.factored_only]
    if mesh.tensor == 1 and tables:
        return "yes", tables[0].name, False
    for table in tables:
        choices = choice_names(table, block.factored, block.online_norm)
        if (layer.residual, layer.attention, layer.act) == (table.residual, table.attention, table.act) and all(
            c in (base, ST) for c, base in zip(layer.choices, choices)
        ):
            return "yes", table.name, table.sequence_parallel
    if len(set(layer.choices) - {ST}) > 1:
        return "no: mixed per-group choices", "", False
    return "no: layouts the strategy tables do not express", "", False


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
