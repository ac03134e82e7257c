"""Tensor-parallel strategies: a registry of logical-axis tables (see the BOOST reference notes).

A strategy is one `register(Registered(...))` entry: its name (`parallel.strategy`), its rule table
and whether online RMSNorm applies. Config validation, the trainer, the comm report and the planner
all read this registry, and the planner prices a strategy from its table (what each projection group
splits over `tensor`, where the activations live: boost_jax/planner/ops/), so a new strategy
is one entry.

Parameter names: embed (hidden d), heads / kv_heads (attention widths), mlp (I), rank (r),
vocab_in / embed of the embedding table, head_embed / vocab of the LM head, norm (a norm scale
over d), head_norm (the final norm), layers (the scanned stack). Activation names start with act_.
FSDP is a fallback row in every table: whatever dim the tensor axis leaves free is split over `fsdp`,
so parameters and optimizer state are sharded and GSPMD gathers them layer by layer.
"""

from __future__ import annotations

import dataclasses

from boost_jax.config import PROJECTION_GROUPS, ST
from boost_jax.errors import ConfigError
from boost_jax.parallel.mesh import split_by_tensor
from boost_jax.parallel.rules import Strategy

BATCH = ("data", "fsdp")

_COMMON_TAIL = (
    # FSDP fallbacks for whatever the tensor axis left unsplit.
    ("embed", "fsdp"),
    ("rank", "fsdp"),
    ("heads", "fsdp"),
    ("kv_heads", "fsdp"),
    ("mlp", "fsdp"),
    ("tt_rank", "fsdp"),
    ("sparse_blocks", "fsdp"),
    ("vocab_in", "fsdp"),
    ("head_embed", "fsdp"),
    ("vocab", "fsdp"),
    ("act_batch", BATCH),
    ("layers", "pipeline"),
    ("head_norm", None),
    # Context parallelism: the sequence of every activation split over `context` (size 1 unless asked).
    ("act_seq", "context"),
    ("act_res_seq", "context"),
)

# BTP: the residual stream stays split along d; every A is row-parallel (its r-wide partial product
# is all-reduced), every B column-parallel (whole heads / MLP columns local); the LM head is
# vocab-parallel after one gather of the final hidden state.
BTP = (
    ("embed", "tensor"),
    ("norm", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("act_embed", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("act_rank", None),
) + _COMMON_TAIL

# Vanilla low-rank TP: each factorised layer treated like a Megatron MLP: A column-parallel (r
# split), B row-parallel, an all-reduce of the full output width after every layer; the residual
# and attention are replicated over the tensor axis.
VANILLA = (
    ("rank", "tensor"),
    ("act_rank", "tensor"),
    ("vocab_in", "tensor"),
    ("vocab", "tensor"),
    ("act_vocab", "tensor"),
    ("act_embed", None),
    ("act_heads", None),
    ("act_kv_heads", None),
    ("act_mlp", None),
    ("norm", None),
) + _COMMON_TAIL

# Megatron: column-parallel q/k/v/gate/up, row-parallel o/down, vocab-parallel embedding and head.
MEGATRON = (
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab_in", "tensor"),
    ("vocab", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("act_embed", None),
    ("act_rank", None),
    ("norm", None),
) + _COMMON_TAIL

# Sequence parallelism: the residual (norms, adds) is split along the sequence between the
# column- and row-parallel regions, turning each all-reduce into a reduce-scatter + all-gather.
MEGATRON_SP = (("act_res_seq", ("context", "tensor")),) + MEGATRON


@dataclasses.dataclass(frozen=True)
class Registered:
    """One strategy. `sequence_parallel`: the table used with `parallel.sequence_parallel` (its residual
    is split along the sequence), if it has one. `factored_only`: its layouts are meant for bottleneck
    kinds (on a dense model they degenerate: every group row-parallel, or replicated), so the planner
    proposes it for factored models only. `report_linear`: the linear kind the comm report measures it
    on when asked for it by name alone (None: the config's own)."""

    name: str
    rules: tuple
    online_norm: bool = False  # parallel.online_norm applies: its norms send their statistics with the A's
    sequence_parallel: tuple | None = None
    factored_only: bool = False
    report_linear: str | None = None

    @property
    def keeps_whole_rank(self) -> bool:
        """Whether its rule table keeps the bottleneck rank whole on every tensor device
        (parallel.context_kv=bottleneck passes σ(A x) r wide and rebuilds K/V with each device's B's;
        a table splitting `rank` over tensor leaves each device a slice)."""
        return not {"rank", "act_rank"} & split_by_tensor(self.rules)


REGISTRY: dict[str, Registered] = {}


def register(entry: Registered) -> Registered:
    REGISTRY[entry.name] = entry
    return entry


register(Registered("btp", BTP, online_norm=True, factored_only=True))
register(Registered("vanilla", VANILLA, factored_only=True))
# Megatron's column of the comm report is the full-rank twin, the baseline BOOST compares with.
register(Registered("megatron", MEGATRON, sequence_parallel=MEGATRON_SP, report_linear="dense"))


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def registered(name: str) -> Registered:
    if name not in REGISTRY:
        raise ConfigError(f"config field `parallel.strategy`: {name!r} is not one of {names()}")
    return REGISTRY[name]


def variants() -> list[tuple[Registered, bool]]:
    """Every (strategy, sequence_parallel) the trainer runs, for the planner and the reports."""
    return [(e, sp) for e in REGISTRY.values() for sp in ((False, True) if e.sequence_parallel else (False,))]


def st_groups(spec: str) -> frozenset:
    """Parse `parallel.linear_partition`: "" (the strategy's own layout), "st" (every projection
    group spatial-temporal) or "group=st,..." for some of qkv, o, mlp_in, mlp_out."""
    spec = spec.strip()
    if not spec:
        return frozenset()
    if spec == ST:
        return frozenset(PROJECTION_GROUPS)
    groups = set()
    for item in spec.split(","):
        group, _, choice = item.partition("=")
        if group.strip() not in PROJECTION_GROUPS or choice.strip() not in (ST, "default"):
            raise ConfigError(
                f"config field `parallel.linear_partition`: {item!r} is not GROUP=st|default "
                f"with GROUP one of {PROJECTION_GROUPS} (or the single value 'st')"
            )
        if choice.strip() == ST:
            groups.add(group.strip())
    return frozenset(groups)


def get_strategy(p) -> Strategy:
    """The Strategy for a `parallel` config section."""
    entry = registered(p.strategy)
    sp = bool(p.sequence_parallel) and entry.sequence_parallel is not None
    return Strategy(
        entry.name + ("_sp" if sp else ""),
        entry.sequence_parallel if sp else entry.rules,
        online_norm=entry.online_norm and bool(p.online_norm),
        st_groups=st_groups(p.linear_partition),
        microbatches=int(p.microbatches) or 2 * int(p.pipeline),
        grad_reduce_dtype=str(p.grad_reduce_dtype),
        pipeline_schedule=str(p.pipeline_schedule),
        pipeline_repeats=int(p.pipeline_repeats),
        context_attention=str(p.context_attention),
        context_kv=str(p.context_kv),
    )
