"""Helpers shared by tests."""
import json
from pathlib import Path

import jax
import numpy as np

from boost_jax.optim import make_optimizer
from boost_jax.parallel.mesh import make_mesh
from boost_jax.parallel.rules import use_rules
from boost_jax.parallel.strategies import get_strategy
from boost_jax.state import state_spec
from boost_jax.step import jit_train_step
from boost_jax.tools.hlo_comm import compile_partitioned


def metric_rows(run_dir, key="loss"):
    """{step: value} of one metric from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    return {r["step"]: r[key] for r in rows if key in r}


def compiled_step(cfg, partitioned=False):
    """(step, batch sharding, spec, mesh, partitioned HLO or None): the trainer's jitted train step,
    compiled once (with `partitioned`, the same compile also yields the HLO after SPMD partitioning,
    whose collectives carry their logical dtypes; XLA:CPU later widens bf16 collectives to float32)."""
    tx, schedule = make_optimizer(cfg.train)
    mesh, strategy = make_mesh(cfg), get_strategy(cfg.parallel)
    with use_rules(mesh, strategy):
        spec = state_spec(cfg, tx, mesh, strategy)
        step, batch_sharding = jit_train_step(spec, tx, schedule, mesh)
        t = cfg.train
        batch = jax.ShapeDtypeStruct((t.grad_accum, t.global_batch // t.grad_accum, t.seq_len + 1), np.int32,
                                     sharding=batch_sharding)
        lowered = step.lower(spec.abstract, batch)
        compiled, text = compile_partitioned(lowered) if partitioned else (lowered.compile(), None)
    return compiled, batch_sharding, spec, mesh, text
