"""Whether the trainer runs a layer partitioning (`runnable`: one of its strategies' rule tables, st groups
as parallel.linear_partition) and that flag's value (`linear_partition`)."""

from __future__ import annotations

from boost_jax.config import PROJECTION_GROUPS, ST
from boost_jax.planner.ops.operators import Block
from boost_jax.planner.ops.strategy_tables import choice_names, strategy_layers
from boost_jax.planner.pricing.plans import Layer, Mesh


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
