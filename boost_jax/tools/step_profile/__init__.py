"""The step-time table: where a GPU step's time goes, read from its compiled program (optimized HLO),
each kernel priced on a target GPU's numbers and grouped into categories. Nothing imports jax at
module level; `python -m boost_jax.tools.step_profile` (and `tools.aot --profile`) print it.

- kernels: every kernel the GPU launches, with its executions per step (loop trip counts), FLOPs,
  HBM bytes and, for a collective, the bytes it moves over the links (hlo_comm's payload rules);
- shapes, sources: HLO shape text -> bytes and dims; HLO stack frames -> project source lines;
- categories: a kernel's category, by what runs (GEMM, attention, collective, copy) or its source;
- overlap: the compute an async collective overlaps (its exposed part counts in the step);
- pricing: each kernel's time on a `Target` under `Costs` fitted to measured steps (targets/
  step_costs.json, benchmarks/step_profile_fit.py); a GEMM is priced by its shape class, since a
  deviceless compile has no GEMM autotuner; the roofline beside each category;
- traces: a jax.profiler trace of the same program grouped by the same categories (`measured`);
- command: the tables and `main`. Measured and predicted steps: benchmarks/RESULTS.md.
"""
