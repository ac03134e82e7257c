"""Tensor-parallel strategies: a registry of logical-axis tables (see the BOOST reference notes).

A strategy is one `register(Registered(...))` entry: its name (`parallel.strategy`), its rule table,
the layouts the planner prices it as, and whether online RMSNorm applies. Config validation, the
trainer, the comm report and the planner all read this registry, so a new strategy is one entry.

Parameter names: embed (hidden d), heads / kv_heads (attention widths), mlp (I), rank (r),
vocab_in / embed of the embedding table, head_embed / vocab of the LM head, norm (a norm scale
over d), head_norm (the final norm), layers (the scanned stack). Activation names start with act_.
FSDP is a fallback row in every table: whatever dim the tensor axis leaves free is split over `fsdp`,
so parameters and optimizer state are sharded and GSPMD gathers them layer by layer.
"""
from __future__ import annotations

import dataclasses

from boost_jax.config import PROJECTION_GROUPS
from boost_jax.errors import ConfigError
from boost_jax.parallel.rules import Strategy

BATCH = ("data", "fsdp")

_COMMON_TAIL = (
    # FSDP fallbacks for whatever the tensor axis left unsplit.
    ("embed", "fsdp"), ("rank", "fsdp"), ("heads", "fsdp"), ("kv_heads", "fsdp"), ("mlp", "fsdp"),
    ("tt_rank", "fsdp"), ("sparse_blocks", "fsdp"),
    ("vocab_in", "fsdp"), ("head_embed", "fsdp"), ("vocab", "fsdp"),
    ("act_batch", BATCH),
    ("layers", "pipeline"), ("head_norm", None),
    # Context parallelism: the sequence of every activation split over `context` (size 1 unless asked).
    ("act_seq", "context"), ("act_res_seq", "context"),
)

# BTP: the residual stream stays split along d; every A is row-parallel (its r-wide partial product
# is all-reduced), every B column-parallel (whole heads / MLP columns local); the LM head is
# vocab-parallel after one gather of the final hidden state.
BTP = (
    ("embed", "tensor"), ("norm", "tensor"), ("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("act_embed", "tensor"), ("act_heads", "tensor"), ("act_kv_heads", "tensor"), ("act_mlp", "tensor"),
    ("act_vocab", "tensor"), ("act_rank", None),
) + _COMMON_TAIL

# Vanilla low-rank TP: each factorised layer treated like a Megatron MLP: A column-parallel (r
# split), B row-parallel, an all-reduce of the full output width after every layer; the residual
# and attention are replicated over the tensor axis.
VANILLA = (
    ("rank", "tensor"), ("act_rank", "tensor"), ("vocab_in", "tensor"), ("vocab", "tensor"),
    ("act_vocab", "tensor"),
    ("act_embed", None), ("act_heads", None), ("act_kv_heads", None), ("act_mlp", None), ("norm", None),
) + _COMMON_TAIL

# Megatron: column-parallel q/k/v/gate/up, row-parallel o/down, vocab-parallel embedding and head.
MEGATRON = (
    ("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("vocab_in", "tensor"), ("vocab", "tensor"),
    ("act_heads", "tensor"), ("act_kv_heads", "tensor"), ("act_mlp", "tensor"), ("act_vocab", "tensor"),
    ("act_embed", None), ("act_rank", None), ("norm", None),
) + _COMMON_TAIL

# Sequence parallelism: the residual (norms, adds) is split along the sequence between the
# column- and row-parallel regions, turning each all-reduce into a reduce-scatter + all-gather.
MEGATRON_SP = (("act_res_seq", ("context", "tensor")),) + MEGATRON




@dataclasses.dataclass(frozen=True)
class Registered:
    """One strategy. `planner`: (residual layout, the partition choice of every projection group,
    attention layout, MLP-activation layout) in the planner's terms (boost_jax/planner/partitions.py:
    layouts R/H/S, choices btp/vanilla/megatron); `sequence_parallel`: the table used with
    `parallel.sequence_parallel` (its residual is split along the sequence, layout S), if it has one."""
    name: str
    rules: tuple
    planner: tuple[str, str, str, str]
    online_norm: bool = False  # parallel.online_norm applies: its norms send their statistics with the A's
    sequence_parallel: tuple | None = None


REGISTRY: dict[str, Registered] = {}


def register(entry: Registered) -> Registered:
    REGISTRY[entry.name] = entry
    return entry


register(Registered("btp", BTP, planner=("H", "btp", "H", "H"), online_norm=True))
register(Registered("vanilla", VANILLA, planner=("R", "vanilla", "R", "R")))
register(Registered("megatron", MEGATRON, planner=("R", "megatron", "H", "H"), sequence_parallel=MEGATRON_SP))


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def registered(name: str) -> Registered:
    if name not in REGISTRY:
        raise ConfigError(f"config field `parallel.strategy`: {name!r} is not one of {names()}")
    return REGISTRY[name]


def variants() -> list[tuple[Registered, bool]]:
    """Every (strategy, sequence_parallel) the trainer runs, for the planner and the reports."""
    return [(e, sp) for e in REGISTRY.values() for sp in ((False, True) if e.sequence_parallel else (False,))]


def planner_layout(name: str, sequence_parallel: bool = False) -> tuple[str, tuple[str, ...], str, str]:
    """(residual layout, group choices, attention layout, act layout) the planner prices `name` as."""
    residual, choice, attention, act = registered(name).planner
    return ("S" if sequence_parallel else residual), (choice,) * len(PROJECTION_GROUPS), attention, act


def st_groups(spec: str) -> frozenset:
    """Parse `parallel.linear_partition`: "" (the strategy's own layout), "st" (every projection
    group spatial-temporal) or "group=st,..." for some of qkv, o, mlp_in, mlp_out."""
    spec = spec.strip()
    if not spec:
        return frozenset()
    if spec == "st":
        return frozenset(PROJECTION_GROUPS)
    groups = set()
    for item in spec.split(","):
        group, _, choice = item.partition("=")
        if group.strip() not in PROJECTION_GROUPS or choice.strip() not in ("st", "default"):
            raise ConfigError(f"config field `parallel.linear_partition`: {item!r} is not GROUP=st|default "
                              f"with GROUP one of {PROJECTION_GROUPS} (or the single value 'st')")
        if choice.strip() == "st":
            groups.add(group.strip())
    return frozenset(groups)


def get_strategy(p) -> Strategy:
    """The Strategy for a `parallel` config section."""
    entry = registered(p.strategy)
    sp = bool(p.sequence_parallel) and entry.sequence_parallel is not None
    return Strategy(entry.name + ("_sp" if sp else ""), entry.sequence_parallel if sp else entry.rules,
                    online_norm=entry.online_norm and bool(p.online_norm), st_groups=st_groups(p.linear_partition),
                    microbatches=int(p.microbatches) or 2 * int(p.pipeline), grad_reduce_dtype=str(p.grad_reduce_dtype),
                    pipeline_schedule=str(p.pipeline_schedule),
                    pipeline_repeats=int(p.pipeline_repeats), context_attention=str(p.context_attention),
                    context_kv=str(p.context_kv))
