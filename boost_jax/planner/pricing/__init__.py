"""How a plan is priced: seconds and bytes for the operators of ops/ on a cluster.

cluster.py (the hardware), plans.py (the planner's words: Mesh, Layer, Options, Cost, Plan, Result),
cost.py (α-β collectives, GEMM and attention time, kept bytes, the constants), schedule.py (a
pipeline's ticks and hand-overs), pricer.py (one pricing context: a layer's operator keys, memoised
with their costs), layer_summary.py (one layer partitioning's totals), step_terms.py (data/fsdp and
pipeline traffic, step seconds, link bytes), memory.py (peak memory per device), trainer_flags.py
(whether the trainer runs a layer) and whole_plan.py (`price_plan`, `lower_bound`).
"""
