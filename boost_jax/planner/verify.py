"""--verify: the planner's per-layer collectives and peak memory next to the compiled step's.

The plan is lowered as the trainer would run it (its strategy, with its st groups as
parallel.linear_partition) on emulated CPU devices, at shapes small enough to compile in seconds;
prediction and measurement use the same shapes. Collectives are compared per layer and per device
by traffic class and kind (count and bytes): tensor-axis forward, tensor-axis backward (recompute
included, as comm_report's backward = forward_backward - forward), the st groups' permutes that
cross fsdp (comm_report's `grid` class), data/fsdp forward + backward (bytes only: XLA issues one
gather per parameter), and every collective of the 2-layer program. Bytes follow comm_report:
elements x the compute dtype on the tensor axis and the grid (bf16: 2), x 4 (fp32 parameters and
gradients) on data/fsdp. All-reduce counts may come out lower than predicted with the same bytes:
XLA's all-reduce combiner merges independent all-reduces into one tuple all-reduce.
Memory: the planner's peak per device against `.memory_analysis()` of the full-depth (scanned)
train step, compiled in float32 (the CPU backend computes bf16 partly in float32, so float32 is the
dtype whose bytes it reports as a GPU would), priced with the attention the CPU runs.
"""
from __future__ import annotations

from boost_jax.planner import partitions as P
from boost_jax.planner.cost import STATE_BYTES
from boost_jax.planner.search import Layer, Mesh, Options, linear_partition, plan_for

TOLERANCE = 0.05  # collective bytes (and counts)
MEMORY_TOLERANCE = 0.15
ACT_BYTES = 2  # logical bytes of a tensor-axis / grid element (bf16 compute)
COMPILE_DTYPE = "float32"
# Every collective of the 2-layer forward+backward program. comm_report's per-layer numbers are the
# 2-layer minus the 1-layer program, which assumes XLA partitions both alike; this row does not.
WHOLE = "2-layer program, all"
MEMORY = "peak memory (memory_analysis)"
MAX_DEVICES = 8  # what the CPU backend emulates comfortably
MAX_GRID_DEVICES = 16  # an st plan on a 4 x 4 grid
CLASSES = (("tensor", "fwd"), ("tensor", "bwd"), ("grid", "fwd+bwd"))


def shrink(mesh: Mesh, seq: int, max_devices: int = MAX_DEVICES, grid: bool = False) -> tuple[Mesh, int, int]:
    """(mesh, batch, seq) to verify a plan on: the same tensor size (up to max_devices) and 2-way
    data / fsdp where the plan has them, one sequence per batch shard, short sequences. `grid`: the
    plan has st groups, which need fsdp == tensor: the grid is kept whole (up to MAX_GRID_DEVICES)."""
    if grid:
        t = mesh.tensor
        if t * t > MAX_GRID_DEVICES:
            raise ValueError(f"an st plan on a {t} x {t} grid needs {t * t} devices; --verify emulates at most "
                             f"{MAX_GRID_DEVICES}")
        d = 2 if mesh.data > 1 and 2 * t * t <= max(max_devices, t * t) else 1
        return Mesh(d, t, t), d * t, min(seq, 128)
    t = max(k for k in range(1, min(mesh.tensor, max_devices) + 1) if mesh.tensor % k == 0 and
            max_devices % k == 0)
    f = 2 if mesh.fsdp > 1 and 2 * t <= max_devices else 1
    d = 2 if mesh.data > 1 and 2 * t * f <= max_devices else 1
    return Mesh(d, f, t), d * f, min(seq, 128)


def _by_class(colls, redo=()) -> dict:
    """{(class, direction, kind): [count, elements]} of one layer's collectives; recomputed ones run
    in the backward."""
    out: dict = {}
    for c, again in [(c, False) for c in colls] + [(c, True) for c in redo]:
        if not c.elements or c.axis == "pipeline":
            continue
        direction = ("bwd" if again else c.phase) if c.axis == "tensor" else "fwd+bwd"
        slot = out.setdefault((c.axis, direction, c.kind), [0, 0.0])
        slot[0] += 1
        slot[1] += c.elements
    return out


def _bytes(axis: str, elements: float) -> float:
    return elements * (STATE_BYTES if axis == "data_fsdp" else ACT_BYTES)


def cpu_attention(cfg, seq: int) -> str:
    """The model.attention the CPU compile runs (what `auto` resolves to there)."""
    from boost_jax.model.attention import auto_impl

    name = cfg.model.attention
    return auto_impl(False, False, cfg.model.d_model // cfg.model.n_heads, seq, seq) if name == "auto" else name


def predicted(cfg, cluster, mesh: Mesh, layer: Layer, remat: str, batch: int, seq: int) -> tuple[dict, float]:
    """({(class, direction, kind): [count, elements]} per layer, the 2-layer program's bytes), and
    the peak memory per device of the float32 program."""
    opts = Options(batch=batch, seq=seq, check_memory=False, act_bytes=ACT_BYTES)
    plan = plan_for(cfg, cluster, mesh, 1, remat, layer, opts, flops_per_token=0.0)
    whole = sum(_bytes(c.axis, c.elements) for c in plan.rest_colls + 2 * (plan.layer_colls + plan.redo_colls))
    f32 = Options(batch=batch, seq=seq, check_memory=False, act_bytes=4, attention=cpu_attention(cfg, seq))
    memory = plan_for(cfg, cluster, mesh, 1, remat, layer, f32, flops_per_token=0.0).memory["total"]
    return {"layer": _by_class(plan.layer_colls, plan.redo_colls), "whole": whole}, memory


def measured(cfg, mesh: Mesh, strategy: str, sequence_parallel: bool, remat: str, batch: int, seq: int,
             partition: str = "", memory: bool = False) -> tuple[dict, float | None]:
    """The same from comm_report (compiled in COMPILE_DTYPE; bytes from elements as above)."""
    from boost_jax.tools.comm_report import _axis_group, report

    cfg = cfg.copy_and_resolve_references()
    cfg.parallel.update(sequence_parallel=sequence_parallel, linear_partition=partition)
    label = f"{strategy}:{cfg.model.linear}"  # explicit linear: bare `megatron` would mean the dense twin
    rep = report(cfg, mesh=(mesh.data, mesh.fsdp, mesh.tensor), strategies=label, batch=batch, seq=seq,
                 dtype=COMPILE_DTYPE, memory=memory, programs=("forward", "forward_backward"), remat=remat)
    col = rep["strategies"][label]
    fwd, fb = col["programs"]["forward"], col["programs"]["forward_backward"]
    layer: dict = {}
    for key in set(fwd["per_layer"]) | set(fb["per_layer"]):
        kind, axis = key.split("@")[0], _axis_group(key)
        f, b = fwd["per_layer"].get(key, {}), fb["per_layer"].get(key, {})
        parts = ((("fwd", f), ("bwd", None)) if axis == "tensor" else (("fwd+bwd", None),))
        for direction, program in parts:
            if program is not None:
                count, elements = program.get("count", 0), program.get("elements", 0)
            elif direction == "bwd":
                count, elements = b.get("count", 0) - f.get("count", 0), b.get("elements", 0) - f.get("elements", 0)
            else:
                count, elements = b.get("count", 0), b.get("elements", 0)
            if count or elements:
                slot = layer.setdefault((axis, direction, kind), [0, 0.0])
                slot[0] += count
                slot[1] += elements
    whole = sum(_bytes(_axis_group(k), v["elements"]) for k, v in fb["rest"].items()) + 2 * sum(
        _bytes(_axis_group(k), v["elements"]) for k, v in fb["per_layer"].items())
    peak = col["memory"]["total_bytes"] if memory and col.get("memory") else None
    return {"layer": layer, "whole": whole}, peak


def _row(name: str, p: float, m: float, tolerance: float, counts=None) -> dict:
    ok = abs(p - m) <= tolerance * max(p, m)
    row = {"traffic": name, "predicted": p, "measured": m, "ratio": p / m if m else float(p == 0), "ok": ok,
           "counts": counts}
    if counts is not None:
        pc, mc = counts
        combined = name.endswith("all-reduce") and mc < pc  # XLA's all-reduce combiner (see the docstring)
        row["ok"] = ok and (abs(pc - mc) <= tolerance * max(pc, mc) or combined)
        row["combined"] = combined
    return row


def compare(cfg, cluster, mesh: Mesh, strategy: str, sequence_parallel: bool = False, remat: str = "none",
            batch: int = 2, seq: int = 64, layer: Layer | None = None, memory: bool = False) -> list[dict]:
    """One row per traffic class and kind: predicted and measured bytes (and counts) per layer per
    device, whether they agree within TOLERANCE; data/fsdp bytes; the whole 2-layer program; with
    `memory`, the peak memory per device within MEMORY_TOLERANCE. `layer`: the plan's layer
    (default: the strategy's uniform one); its st groups run as parallel.linear_partition on the
    fsdp x tensor grid (fsdp == tensor)."""
    layer = layer or Layer(*P.uniform_plan(strategy, sequence_parallel))
    pred, pred_memory = predicted(cfg, cluster, mesh, layer, remat, batch, seq)
    meas, meas_memory = measured(cfg, mesh, strategy, sequence_parallel, remat, batch, seq, linear_partition(layer),
                                 memory)
    rows = []
    for axis, direction in CLASSES:
        keys = sorted({k for k in list(pred["layer"]) + list(meas["layer"]) if k[:2] == (axis, direction)})
        for key in keys:
            (pc, pe), (mc, me) = pred["layer"].get(key, (0, 0.0)), meas["layer"].get(key, (0, 0.0))
            rows.append(_row(f"{axis} {direction}: {key[2]}", _bytes(axis, pe), _bytes(axis, me), TOLERANCE,
                             (pc, mc)))
    data = [sum(_bytes(k[0], v[1]) for k, v in d["layer"].items() if k[0] == "data_fsdp") for d in (pred, meas)]
    if any(data):
        rows.append(_row("data/fsdp fwd+bwd", *data, TOLERANCE))
    rows.append(_row(WHOLE, pred["whole"], meas["whole"], TOLERANCE))
    if memory:
        rows.append(_row(MEMORY, pred_memory, meas_memory, MEMORY_TOLERANCE))
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
