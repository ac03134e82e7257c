"""The comm report: per-device communication of each tensor-parallel strategy, read from compiled
HLO (nothing allocated); `python -m boost_jax.tools.comm_report --config ... --mesh ... --strategy ...`.

Each strategy's model is lowered from abstract shapes and compiled three ways (the forward loss,
forward+backward, the trainer's train step) at n_layers=1 and 2 with the layer scan unrolled: per
layer = (2 layers) - (1 layer), the rest = (1 layer) - per layer, the model = rest + L x per layer.
Bytes are elements x each collective's dtype as partitioned (`hlo_comm.partitioned_hlo`), since
XLA's CPU backend widens bf16 collectives to float32 in the optimized program.

- programs: each strategy column's config (`variant_config`) and the compiled programs;
- tallies: a program's collectives by kind and mesh axes, and their sums;
- tables: the markdown tables; pipeline: a pipelined step's collectives by kind and axis;
- command: one strategy measured (`measure`), every strategy (`report`) and `main`.
"""

from boost_jax.tools.comm_report.command import measure, report

__all__ = ["measure", "report"]  # the package's face: `comm_report.report(...)`, as the notebooks call it
