"""--verify: the planner's per-layer collectives next to what comm_report reads from the compiled HLO.

The plan is lowered as the trainer would run it (its strategy, with its st groups as
parallel.linear_partition) on emulated CPU devices, at shapes small enough to compile in seconds;
prediction and measurement use the same shapes. Compared per layer and per device, in elements:
tensor-axis forward, tensor-axis backward (recompute included, as comm_report's backward =
forward_backward - forward), data/fsdp forward + backward, and the st groups' permutes that cross
fsdp (comm_report's `grid` class).
Bytes follow comm_report: elements x the compute dtype (bf16) on the tensor axis, x 4 (fp32
parameters and gradients) on data/fsdp.
"""
from __future__ import annotations

from boost_jax.planner import partitions as P
from boost_jax.planner.cost import STATE_BYTES
from boost_jax.planner.search import Layer, Mesh, Options, linear_partition, plan_for

TOLERANCE = 0.10
ACT_BYTES = 2  # comm_report's dtype="bfloat16"
# Every collective of the 2-layer forward+backward program. comm_report's per-layer numbers are the
# 2-layer minus the 1-layer program, which assumes XLA partitions both alike; this row does not.
WHOLE = "2-layer program, all"
MAX_DEVICES = 8  # what the CPU backend emulates comfortably


def shrink(mesh: Mesh, seq: int, max_devices: int = MAX_DEVICES) -> tuple[Mesh, int, int]:
    """(mesh, batch, seq) to verify a plan on: the same tensor size (up to max_devices) and 2-way
    data / fsdp where the plan has them, one sequence per batch shard, short sequences."""
    t = max(k for k in range(1, min(mesh.tensor, max_devices) + 1) if mesh.tensor % k == 0 and
            max_devices % k == 0)
    f = 2 if mesh.fsdp > 1 and 2 * t <= max_devices else 1
    d = 2 if mesh.data > 1 and 2 * t * f <= max_devices else 1
    return Mesh(d, f, t), d * f, min(seq, 128)


def predicted(cfg, cluster, mesh: Mesh, layer: Layer, remat: str, batch: int, seq: int) -> dict:
    opts = Options(batch=batch, seq=seq, check_memory=False, act_bytes=ACT_BYTES)
    plan = plan_for(cfg, cluster, mesh, 1, remat, layer, opts, flops_per_token=0.0)

    def nbytes(colls):
        return sum(c.elements * (STATE_BYTES if c.axis == "data_fsdp" else ACT_BYTES) for c in colls)

    tensor = [c for c in plan.layer_colls if c.axis == "tensor"]
    redo = [c for c in plan.redo_colls if c.axis == "tensor"]
    out = {"tensor fwd": nbytes(c for c in tensor if c.phase == "fwd"),
           # the remat recompute runs inside the backward
           "tensor bwd": nbytes([c for c in tensor if c.phase == "bwd"] + redo),
           "data/fsdp fwd+bwd": nbytes(c for c in plan.layer_colls if c.axis == "data_fsdp")}
    if "st" in layer.choices:  # the spatial-temporal groups' permutes over the fsdp x tensor grid
        out["st grid fwd+bwd"] = nbytes([c for c in plan.layer_colls + plan.redo_colls if c.axis == "grid"])
    out[WHOLE] = nbytes(plan.rest_colls + 2 * (plan.layer_colls + plan.redo_colls))
    return out


def measured(cfg, mesh: Mesh, strategy: str, sequence_parallel: bool, remat: str, batch: int, seq: int,
             partition: str = "") -> dict:
    from boost_jax.tools.comm_report import report

    cfg = cfg.copy_and_resolve_references()
    cfg.parallel.update(sequence_parallel=sequence_parallel, linear_partition=partition)
    label = f"{strategy}:{cfg.model.linear}"  # explicit linear: bare `megatron` would mean the dense twin
    rep = report(cfg, mesh=(mesh.data, mesh.fsdp, mesh.tensor), strategies=label, batch=batch, seq=seq,
                 dtype="bfloat16", memory=False, programs=("forward", "forward_backward"), remat=remat)
    col = rep["strategies"][label]

    def nbytes(direction, group):
        return float(col[f"per_layer_{direction}"].get(group, {}).get("bytes", 0))

    fb = col["programs"]["forward_backward"]
    whole = sum(v["bytes"] for v in fb["rest"].values()) + 2 * sum(v["bytes"] for v in fb["per_layer"].values())
    out = {"tensor fwd": nbytes("forward", "tensor"), "tensor bwd": nbytes("backward", "tensor"),
           "data/fsdp fwd+bwd": nbytes("forward", "data_fsdp") + nbytes("backward", "data_fsdp")}
    if partition:
        out["st grid fwd+bwd"] = nbytes("forward", "grid") + nbytes("backward", "grid")
    out[WHOLE] = whole
    return out


def compare(cfg, cluster, mesh: Mesh, strategy: str, sequence_parallel: bool = False, remat: str = "none",
            batch: int = 2, seq: int = 64, layer: Layer | None = None) -> list[dict]:
    """One row per traffic class: predicted and measured bytes per layer per device, and whether they
    agree within TOLERANCE. `layer`: the plan's layer (default: the strategy's uniform one); its st
    groups run as parallel.linear_partition on the fsdp x tensor grid (fsdp == tensor)."""
    layer = layer or Layer(*P.uniform_plan(strategy, sequence_parallel))
    pred = predicted(cfg, cluster, mesh, layer, remat, batch, seq)
    meas = measured(cfg, mesh, strategy, sequence_parallel, remat, batch, seq, linear_partition(layer))
    rows = []
    for key in pred:
        p, m = pred[key], meas[key]
        ok = abs(p - m) <= TOLERANCE * max(p, m)
        rows.append({"traffic": key, "predicted": p, "measured": m, "ratio": p / m if m else float(p == 0),
                     "ok": ok})
    return rows


# ---------------------------------------------------------------- pipelined plans

def shrink_pipeline(mesh: Mesh, seq: int, max_devices: int = MAX_DEVICES) -> tuple[Mesh, int]:
    """(mesh, seq) to verify a pipelined plan on: 2 stages, then as `shrink` within what is left."""
    inner, _, seq = shrink(Mesh(mesh.data, mesh.fsdp, mesh.tensor), seq, max_devices // 2)
    return Mesh(inner.data, inner.fsdp, inner.tensor, pipeline=2), seq


def _axis_class(axes) -> str:
    return "pipeline" if "pipeline" in axes else "data/fsdp" if {"data", "fsdp"} & set(axes) else "tensor"


def compare_pipeline(cfg, cluster, mesh: Mesh, strategy: str, sequence_parallel: bool = False,
                     remat: str = "none", microbatches: int = 0, seq: int = 64) -> list[dict]:
    """A pipelined plan's whole-step collectives (one accumulation micro-batch, every GPipe tick) next
    to comm_report.pipeline_report's count in the compiled, unrolled train step, in elements per device
    by traffic class (pipeline / tensor / data-fsdp). The model is cut to one layer per stage."""
    from boost_jax.tools.comm_report import pipeline_report

    m = microbatches or 2 * mesh.pipeline
    batch = mesh.data * mesh.fsdp * m
    cfg = cfg.copy_and_resolve_references()
    cfg.model.n_layers = mesh.pipeline
    cfg.parallel.update(sequence_parallel=sequence_parallel, microbatches=m)
    layer = Layer(*P.uniform_plan(strategy, sequence_parallel))
    opts = Options(batch=batch, seq=seq, check_memory=False, act_bytes=ACT_BYTES)
    plan = plan_for(cfg, cluster, mesh, 1, remat, layer, opts, flops_per_token=0.0, microbatches=m)
    pred: dict = {}
    for c, times in plan.step_colls:
        key = {"data_fsdp": "data/fsdp"}.get(c.axis, c.axis)
        pred[key] = pred.get(key, 0.0) + times * c.elements
    rep = pipeline_report(cfg, (mesh.pipeline, mesh.data, mesh.fsdp, mesh.tensor), strategy, batch=batch, seq=seq,
                          dtype="bfloat16", remat=remat)
    meas: dict = {}
    for c in rep["collectives"]:
        key = _axis_class(c["axes"])
        meas[key] = meas.get(key, 0.0) + c["elements"]
    rows = []
    for key in ("pipeline", "tensor", "data/fsdp"):
        p, q = pred.get(key, 0.0), meas.get(key, 0.0)
        if p == q == 0:
            continue
        rows.append({"traffic": f"{key} (whole step)", "predicted": p, "measured": q,
                     "ratio": p / q if q else float(p == 0), "ok": abs(p - q) <= TOLERANCE * max(p, q)})
    return rows
