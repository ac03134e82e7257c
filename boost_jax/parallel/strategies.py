"""The three tensor-parallel strategies as logical-axis tables (see the BOOST reference notes).

Parameter names: embed (hidden d), heads / kv_heads (attention widths), mlp (I), rank (r),
vocab_in / embed of the embedding table, head_embed / vocab of the LM head, norm (a norm scale
over d), head_norm (the final norm), layers (the scanned stack). Activation names start with act_.
FSDP is a fallback row in every table: whatever dim the tensor axis leaves free is split over `fsdp`,
so parameters and optimizer state are sharded and GSPMD gathers them layer by layer.
"""
from __future__ import annotations

from boost_jax.parallel.rules import Strategy

BATCH = ("data", "fsdp")

_COMMON_TAIL = (
    # FSDP fallbacks for whatever the tensor axis left unsplit.
    ("embed", "fsdp"), ("rank", "fsdp"), ("heads", "fsdp"), ("kv_heads", "fsdp"), ("mlp", "fsdp"),
    ("tt_rank", "fsdp"), ("sparse_blocks", "fsdp"),
    ("vocab_in", "fsdp"), ("head_embed", "fsdp"), ("vocab", "fsdp"),
    ("act_batch", BATCH),
    ("layers", "pipeline"), ("head_norm", None), ("act_seq", None), ("act_res_seq", None),
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
MEGATRON_SP = (("act_res_seq", "tensor"),) + MEGATRON


PROJECTION_GROUPS = ("qkv", "o", "mlp_in", "mlp_out")


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
            raise ValueError(f"config field `parallel.linear_partition`: {item!r} is not GROUP=st|default "
                             f"with GROUP one of {PROJECTION_GROUPS} (or the single value 'st')")
        if choice.strip() == "st":
            groups.add(group.strip())
    return frozenset(groups)


def get_strategy(p) -> Strategy:
    """The Strategy for a `parallel` config section."""
    extra = dict(st_groups=st_groups(p.linear_partition), microbatches=int(p.microbatches) or 2 * int(p.pipeline),
                 grad_reduce_dtype=str(p.grad_reduce_dtype))
    if p.strategy == "btp":
        return Strategy("btp", BTP, online_norm=bool(p.online_norm), **extra)
    if p.strategy == "vanilla":
        return Strategy("vanilla", VANILLA, **extra)
    if p.strategy == "megatron":
        return Strategy("megatron_sp" if p.sequence_parallel else "megatron",
                        MEGATRON_SP if p.sequence_parallel else MEGATRON, **extra)
    raise ValueError(f"config field `parallel.strategy`: unknown {p.strategy!r}")
