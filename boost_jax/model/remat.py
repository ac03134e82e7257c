"""Activation checkpointing policies, chosen by name from `remat.policy`.

- none: save everything the backward wants (fastest, most memory).
- full: save only each block's input (the residual carried by the layer scan); recompute the rest.
- dots: save matmul outputs without batch dims (XLA's usual choice) and the attention output and
  log-sum-exp (`attn_out`, `attn_lse`), so a fused attention is not re-run in the backward.
- lowrank: save only the r-wide, fully reduced A·x tensors tagged `lowrank` and the per-row norm
  statistics (CoLA-M / BOOST); recompute σ, the B expansions, attention (its `attn_out`/`attn_lse`
  are deliberately not kept) and the MLP product. Under BTP those tensors are replicated over
  `tensor`, so the recompute needs no collective.
- offload_lowrank: as lowrank, but the saved tensors live in pinned host memory.
"""

from __future__ import annotations

import jax

POLICIES = ("none", "full", "dots", "lowrank", "offload_lowrank")  # remat.policy
# The policies the planner prices (boost_jax/planner/pricing/cost.py `recomputed`, `saved_bytes`), in the order
# it searches them, with what the backward finds kept; the others are not priced.
PRICED = {"none": "everything", "lowrank": "the bottleneck outputs and norm statistics", "full": "each layer's input"}
SAVED_NAMES = ("lowrank", "norm_stats")  # r-wide reduced A outputs; per-row norm statistics
ATTENTION_NAMES = ("attn_out", "attn_lse")  # attention output and its float32 log-sum-exp


def policy(name: str):
    cp = jax.checkpoint_policies
    if name == "full":
        return cp.nothing_saveable
    if name == "dots":
        return cp.save_from_both_policies(
            cp.dots_with_no_batch_dims_saveable, cp.save_only_these_names(*ATTENTION_NAMES)
        )
    if name == "lowrank":
        return cp.save_only_these_names(*SAVED_NAMES)
    if name == "offload_lowrank":
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=list(SAVED_NAMES),
            offload_src="device",
            offload_dst="pinned_host",
        )
    raise ValueError(f"unknown remat policy {name!r}")


def wrap(fn, name: str):
    """`fn` under the named policy; `none` returns it untouched."""
    if name == "none":
        return fn
    return jax.checkpoint(fn, policy=policy(name), prevent_cse=False)
