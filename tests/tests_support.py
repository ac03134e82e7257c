"""Helpers shared by tests."""
import json
from pathlib import Path

from boost_jax.runtime.build import build
from boost_jax.tools.hlo_comm import compile_partitioned


def metric_rows(run_dir, key="loss"):
    """{step: value} of one metric from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    return {r["step"]: r[key] for r in rows if key in r}


def compiled_step(cfg, partitioned=False):
    """(compiled step, the build, partitioned HLO or None): the trainer's jitted train step (the
    runtime's builder), compiled once (with `partitioned`, the same compile also yields the HLO after
    SPMD partitioning, whose collectives carry their logical dtypes; XLA:CPU later widens bf16
    collectives to float32)."""
    built = build(cfg)
    lowered = built.lower_train()
    compiled, text = compile_partitioned(lowered) if partitioned else (lowered.compile(), None)
    return compiled, built, text
