"""What a partition choice *does* (hardware-free): the GEMMs, collectives and activations it implies.

A transformer block is priced as a small graph. Between operators an activation [M tokens, width]
lives on the `tensor` group (t devices) in one of these layouts:

    R  replicated            H  features split t ways      S  tokens split t ways
    P  partial sums still to be reduced (only ever an operator's output)

Operators are the four projection groups (qkv, o, mlp_in, mlp_out), the attention and
MLP-activation cores (run in whatever layout they are fed) and the RMSNorms. Edges between operators
redistribute the activation when layouts differ. A group's partition choice is what a registered
strategy's rule table does to it (`Split`: which stage splits which dim over `tensor`, read from the
table through `spec_for`, as the trainer lays the weights out; see `strategy_layers`), named after the
first registered strategy that does it, or the spatial-temporal choice `st`.
Everything is per device and per micro-batch; M is the micro-batch's tokens on one tensor group.

The spatial-temporal choice (`st`, PrimePar's P(n x n)) runs on the grid the trainer uses
(boost_jax/model/linear.py): the `fsdp` x `tensor` axes with fsdp == tensor = n. The grid's rows
are the fsdp shards of the batch, so its tokens are the M of one tensor group and its activations
enter and leave in H; its weights stay split over both axes (never gathered by FSDP).
Element counts follow boost_jax.tools.comm_report: all-reduce / reduce-scatter / all-to-all /
collective-permute count their operand, all-gather its result.

Where each part lives (this module re-exports their names): operators.py (Block, Ctx, Op and its
Gemm / StMatmul / Coll / Attn, layouts), kept_arrays.py (the SAVED_* counts), edges.py (edges, norms,
the residual add), projections.py (group choices and their work, st's stored layouts), cores.py
(attention with its context exchange, the MLP activation), outside_stack.py (embedding, head, the
pipeline's traffic), strategy_tables.py (Split, the trainer's strategies read from their rule tables).
"""

from __future__ import annotations

from boost_jax.config import PROJECTION_GROUPS as GROUPS  # noqa: F401 - the trainer's group names
from boost_jax.config import ST  # noqa: F401 - re-exported
from boost_jax.planner.cores import (  # noqa: F401 - re-exported
    activation,
    attention,
    attention_class,
    context_exchange,
)
from boost_jax.planner.edges import edge, norm, residual_add  # noqa: F401 - re-exported
from boost_jax.planner.kept_arrays import (  # noqa: F401 - re-exported
    GPU_SAVED_NORM,
    GPU_SAVED_NORM_XLA,
    GPU_SAVED_ONLINE_NORM32,
    GPU_SAVED_SWIGLU,
    RING_SCORE_BLOCKS,
    SAVED_LINEAR,
    SAVED_NORM,
    SAVED_ONLINE_NORM,
    SAVED_SIGMA,
    SAVED_SWIGLU,
)
from boost_jax.planner.operators import (  # noqa: F401 - re-exported
    Attn,
    Block,
    Coll,
    Ctx,
    Gemm,
    Op,
    StMatmul,
    divides,
    gpu,
    layouts,
)
from boost_jax.planner.outside_stack import (  # noqa: F401 - re-exported
    circular_reorder,
    embedding,
    head,
    pipeline_ends,
    stage_shift,
)
from boost_jax.planner.projections import (  # noqa: F401 - re-exported
    group_choices,
    group_op,
    partial_input_grad,
    st_stored,
    stored_grid_axes,
)
from boost_jax.planner.strategy_tables import (  # noqa: F401 - re-exported
    GRID,
    NONE,
    NORMED,
    Split,
    TableLayer,
    choice_names,
    strategy_layers,
    uniform_plan,
)
