"""What is priced, hardware-free: a transformer block as a small graph of operators, and the GEMMs,
collectives and kept activations a partition choice gives each (per device, per micro-batch).

Between operators an activation [M tokens, width] lives on the `tensor` group (t devices) in one
layout: R replicated, H features split t ways, S tokens split t ways, or P partial sums still to be
reduced (only an operator's output). Edges redistribute it where layouts differ. A projection
group's choice is what a registered strategy's rule table does to it (strategy_tables.py), or the
spatial-temporal `st` (PrimePar's P(n x n) on the fsdp x tensor grid, as boost_jax/model/linear.py
runs it). Element counts follow boost_jax.tools.comm_report: all-reduce / reduce-scatter /
all-to-all / collective-permute count their operand, all-gather its result.

operators.py (the records: Block, Ctx, Op, layouts), kept_arrays.py (what each operator keeps),
edges.py (redistributions, norms, the residual add), projections.py (group choices), cores.py
(attention, the MLP activation), outside_stack.py (embedding, head, pipeline traffic),
strategy_tables.py (the trainer's strategies read from their rule tables).
"""
