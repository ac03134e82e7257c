"""A pipelined train step's collectives by kind and mesh axis (`python -m boost_jax.tools.comm_report
--mesh pipeline,data,fsdp,tensor`)."""

from __future__ import annotations

import math

from boost_jax.parallel.pipeline.arithmetic import bubble_fraction, ticks, ticks_1f1b
from boost_jax.tools.comm_report.programs import compile_program, variant_config
from boost_jax.tools.devices import load_config, pick_devices
from boost_jax.tools.hlo_comm import parse_collectives, summarize


def pipeline_report(
    cfg_or_path,
    mesh,
    strategy: str | None = None,
    batch: int = 8,
    seq: int = 256,
    dtype: str = "bfloat16",
    remat: str | None = None,
    schedule: str | None = None,
    repeats: int = 1,
) -> dict:
    """A pipelined step's collectives by kind and mesh axis (whole step, every loop unrolled, so the
    pipeline's collective-permutes are counted once per tick). mesh = (pipeline, data, fsdp, tensor);
    strategy None: the first registered; schedule None: the config's (with `repeats` chunks per stage
    for circular and 1f1b). The per-layer method of `report` does not apply: layers only exist in
    whole stages. 1f1b's forward and backward sit in branches its stages take V M of its lockstep
    ticks: the counts are the unrolled program's operations, the branches' in every tick."""
    from boost_jax.parallel.strategies import names  # lazy: loads JAX; the callers set the emulated devices first

    strategy = strategy or names()[0]

    pipeline, *rest = mesh
    devices = pick_devices(math.prod(mesh))
    base = load_config(cfg_or_path)
    cfg = variant_config(base, strategy, base.model.linear, tuple(rest), batch, seq, dtype, remat)
    cfg.parallel.update(pipeline=pipeline, num_devices=math.prod(mesh))
    if schedule is not None:
        cfg.parallel.update(pipeline_schedule=schedule, pipeline_repeats=repeats)
    schedule, repeats = str(cfg.parallel.pipeline_schedule), int(cfg.parallel.pipeline_repeats)
    compiled, mesh_obj, seconds = compile_program(cfg, "train_step", devices, cfg.model.n_layers, unroll=True)
    table = summarize(parse_collectives(compiled.as_text(), mesh_obj), by=("kind", "axes"))
    micro = cfg.parallel.microbatches or 2 * pipeline
    n_ticks = ticks_1f1b(pipeline, micro, repeats) if schedule == "1f1b" else ticks(pipeline, micro, repeats)
    return {
        "config": base.name,
        "mesh": dict(zip(("pipeline", "data", "fsdp", "tensor"), mesh)),
        "strategy": strategy,
        "batch": batch,
        "seq": seq,
        "dtype": dtype,
        "n_layers": int(cfg.model.n_layers),
        "schedule": schedule,
        "repeats": repeats,
        "microbatches": micro,
        "ticks": n_ticks,
        "bubble": bubble_fraction(pipeline, micro, repeats),
        "compile_s": round(seconds, 2),
        "collectives": [{"kind": k, "axes": list(a), **v} for (k, a), v in sorted(table.items())],
    }
