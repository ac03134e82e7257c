"""The trainer's strategies in the planner's terms: what a registered strategy's rule table does to each
projection group (`Split`), read from the table the way the trainer lays out weights and pins
activations (`strategy_layers`), and a strategy's whole layer (`uniform_plan`, `choice_names`)."""

from __future__ import annotations

import dataclasses
import types

from boost_jax.config import PROJECTION_GROUPS as GROUPS

# The groups a norm feeds (the first of each residual segment): their norm's statistics may ride in
# a row-parallel first stage's all-reduce (online RMSNorm).
NORMED = ("qkv", "mlp_in")


@dataclasses.dataclass(frozen=True, order=True)
class Split:
    """What a layout splits of a projection group over `tensor`. A factored kind: `first` (A: "in" its
    input features, row-parallel, the r-wide partial products then reduced; "rank" its bottleneck
    columns) and `second` (B: "rank", row-parallel, output left partial; "out" its output features,
    column-parallel); "" splits nothing. A dense kind: `first` alone ("in" or "out"). `fused`: the
    norm in front sends its statistics with A's all-reduce (the strategy's online RMSNorm). GRID:
    the spatial-temporal P(n x n) on the (fsdp, tensor) grid."""

    first: str = ""
    second: str = ""
    fused: bool = False

    def layouts(self, factored: bool) -> tuple[str, str]:
        """(input layout, output layout) of the group."""
        if self == GRID:
            return "H", "H"
        inp = "H" if self.first == "in" else "R"
        if not factored:
            return inp, {"in": "P", "out": "H"}.get(self.first, "R")
        return inp, {"rank": "P", "out": "H"}.get(self.second, "R")

    def split_axes(self, group: str, factored: bool) -> list[str]:
        """The logical axes this split divides over `tensor` (see PROJECTION_AXES): "rank" for the
        bottleneck."""
        from boost_jax.model.transformer import PROJECTION_AXES  # lazy: imports jax; not at the planner's import

        in_axis, out_axes = PROJECTION_AXES[group]
        stage = {"in": [in_axis], "out": list(out_axes), "rank": ["rank"], "": []}
        return stage[self.first] + (stage[self.second] if factored else [])


NONE = Split()  # tensor 1: nothing is split
GRID = Split("grid", "grid")


@dataclasses.dataclass(frozen=True)
class TableLayer:
    """A registered strategy's layer in the planner's terms, read from its rule table: the residual
    stream's layout, each group's Split (None: the table gives the group no single layout, which is
    not priced), the layouts the attention and MLP activation run in."""

    name: str
    sequence_parallel: bool
    factored_only: bool
    residual: str
    splits: tuple
    attention: str
    act: str


_TABLES: dict = {}


def strategy_layers(factored: bool, online_norm: bool = True) -> tuple[TableLayer, ...]:
    """Every registered strategy (and its sequence-parallel table) as the planner prices it, in
    registry order, read from the rule tables with boost_jax.parallel.rules.spec_for on a mesh whose
    only split axis is `tensor`, the way the trainer lays out weights and pins activations. Sizes are
    left out (whether a mesh divides a split is the planner's check: `group_choices`, `layouts`).
    `online_norm`: parallel.online_norm, which the strategy's own flag must also allow."""
    from boost_jax.parallel import strategies  # lazy: imports jax; not at the planner's import

    registry = tuple(strategies.REGISTRY.values())
    if _TABLES.get("registry") != registry:  # a strategy was registered since: derive again
        _TABLES.clear()
        _TABLES["registry"] = registry
    key = (factored, online_norm)
    if key not in _TABLES:
        _TABLES[key] = tuple(_table_layer(e, sp, factored, online_norm) for e, sp in strategies.variants())
    return _TABLES[key]


def _table_layer(entry, sp: bool, factored: bool, online_norm: bool) -> TableLayer:
    from boost_jax.model.linear import RESIDUAL  # lazy: imports jax; memoised, off the DP's path
    from boost_jax.model.transformer import CORE_AXES, PROJECTION_AXES  # lazy: imports jax, as above
    from boost_jax.parallel.rules import spec_for  # lazy: imports jax; memoised, off the DP's path

    rules = entry.sequence_parallel if sp else entry.rules
    mesh = types.SimpleNamespace(shape={"pipeline": 1, "data": 1, "fsdp": 1, "tensor": 2})

    def split_dims(names) -> tuple[bool, ...]:
        spec = tuple(spec_for(names, (2,) * len(names), mesh, rules))
        return tuple(i < len(spec) and spec[i] is not None for i in range(len(names)))

    def layout(names) -> str:  # [batch, sequence, features]
        _, seq, features = split_dims(names)
        return "S" if seq else "H" if features else "R"

    def group_split(group: str) -> Split | None:
        in_axis, out_axes = PROJECTION_AXES[group]
        found = set()
        for out in out_axes:
            if not factored:
                d_in, d_out = split_dims((in_axis, out))
                found.add(Split("in" if d_in else "out" if d_out else ""))
                continue
            a_in, a_rank = split_dims((in_axis, "rank"))
            b_rank, b_out = split_dims(("rank", out))
            first = "in" if a_in else "rank" if a_rank else ""
            found.add(
                Split(
                    first,
                    "rank" if b_rank else "out" if b_out else "",
                    fused=first == "in" and group in NORMED and entry.online_norm and online_norm,
                )
            )
        return found.pop() if len(found) == 1 else None

    return TableLayer(
        entry.name,
        sp,
        entry.factored_only,
        layout(RESIDUAL),
        tuple(group_split(g) for g in GROUPS),
        layout(CORE_AXES["attention"]),
        layout(CORE_AXES["act"]),
    )


def uniform_plan(
    strategy: str, sequence_parallel: bool = False, factored: bool = True, online_norm: bool = True
) -> tuple[str, tuple[str, ...], str, str]:
    """(residual layout, group choices, attention layout, act layout) of a trainer strategy, as its
    rule table lays it out (boost_jax/parallel/strategies.py; see `strategy_layers`)."""
    from boost_jax.parallel.strategies import registered  # lazy: imports jax; not at the planner's import

    registered(strategy)  # an unknown name: the ConfigError naming the registered ones
    for table in strategy_layers(factored, online_norm):
        if (table.name, table.sequence_parallel) == (strategy, bool(sequence_parallel)):
            return table.residual, choice_names(table, factored, online_norm), table.attention, table.act
    raise ValueError(f"strategy {strategy!r} has no sequence-parallel table")


def choice_names(table: TableLayer, factored: bool, online_norm: bool = True) -> tuple[str, ...]:
    """The choice names of a strategy's groups: each named after the first registered strategy whose
    table splits it alike (see `group_choices`)."""
    first: dict = {}
    for other in strategy_layers(factored, online_norm):
        if other.factored_only and not factored:
            continue
        for group, split in zip(GROUPS, other.splits):
            first.setdefault((group, split), other.name)
    return tuple(first.get((group, split), table.name) for group, split in zip(GROUPS, table.splits))
