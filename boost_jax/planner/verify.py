"""--verify: the planner's per-layer collectives and peak memory next to the compiled step's.

The plan is lowered as the trainer runs it (its strategy, st groups as parallel.linear_partition) on
emulated CPU devices, at shapes small enough to compile in seconds; prediction and measurement use
the same shapes. Collectives are compared per layer and per device by traffic class and kind (count
and bytes): tensor-axis forward, tensor-axis backward (recompute included), the st groups' permutes
that cross fsdp (`grid`), the context exchange (`context`: plans with parallel.context = C compile at
their C and modes), data/fsdp forward + backward (bytes only: XLA issues one gather per parameter),
and every collective of the 2-layer program. Bytes follow comm_report (the compute dtype on the tensor
axis and the grid, float32 on data/fsdp). XLA's all-reduce combiner may merge all-reduces (fewer, same
bytes); groups of one device move nothing and are left out. Memory: the planner's peak per device
against `.memory_analysis()` of the full-depth train step compiled in float32 (the dtype the CPU
backend reports as a GPU would), priced with the attention the CPU runs.
"""

from __future__ import annotations

import re

from boost_jax.config import PROJECTION_GROUPS, ST
from boost_jax.parallel.pipeline.arithmetic import ticks_1f1b
from boost_jax.planner.ops.operators import Block
from boost_jax.planner.ops.strategy_tables import uniform_plan
from boost_jax.planner.pricing.cost import STATE_BYTES
from boost_jax.planner.pricing.plans import Layer, Mesh, Options
from boost_jax.planner.pricing.trainer_flags import linear_partition
from boost_jax.planner.search import plan_for
from boost_jax.tools.comm_report.command import report
from boost_jax.tools.comm_report.programs import compile_program, memory_breakdown, variant_config
from boost_jax.tools.comm_report.tallies import axis_group
from boost_jax.tools.devices import pick_devices
from boost_jax.tools.hlo_comm import parse_collectives

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
CLASSES = (("tensor", "fwd"), ("tensor", "bwd"), ("grid", "fwd+bwd"), ("context", "fwd+bwd"))


def shrink(mesh: Mesh, seq: int, max_devices: int = MAX_DEVICES, grid: bool = False) -> tuple[Mesh, int, int]:
    """(mesh, batch, seq) to verify a plan on: the same tensor size (up to max_devices) and 2-way
    data / fsdp (and context) where the plan has them, one sequence per batch shard, short sequences. `grid`: the
    plan has st groups, which need fsdp == tensor: the grid is kept whole (up to MAX_GRID_DEVICES)."""
    if grid:
        t = mesh.tensor
        if t * t > MAX_GRID_DEVICES:
            raise ValueError(
                f"an st plan on a {t} x {t} grid needs {t * t} devices; --verify emulates at most {MAX_GRID_DEVICES}"
            )
        d = 2 if mesh.data > 1 and 2 * t * t <= max(max_devices, t * t) else 1
        return Mesh(d, t, t), d * t, min(seq, 128)
    c = 2 if mesh.context > 1 else 1  # a context plan: 2-way context (its attention and kv modes as planned)
    t = max(
        k for k in range(1, min(mesh.tensor, max_devices // c) + 1) if mesh.tensor % k == 0 and max_devices % k == 0
    )
    f = 2 if mesh.fsdp > 1 and 2 * t * c <= max_devices else 1
    d = 2 if mesh.data > 1 and 2 * t * f * c <= max_devices else 1
    return Mesh(d, f, t, context=c), d * f, min(seq, 128)


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
    """Bytes of `elements` on `axis` for the comparison: both sides read elements alike (the ring's
    float32 dK/dV too), so agreement does not depend on the dtype each collective moves."""
    return elements * (STATE_BYTES if axis == "data_fsdp" else ACT_BYTES)


def cpu_attention(cfg, seq: int, context: int = 1) -> str:
    """The model.attention the CPU compile runs (what `auto` resolves to there, or under context)."""
    from boost_jax.model.attention import auto_impl, under_context  # lazy: imports jax; not at the planner's import

    name = cfg.model.attention
    if context > 1:
        return under_context(name)
    return auto_impl(False, False, cfg.model.d_model // cfg.model.n_heads, seq, seq) if name == "auto" else name


def predicted(
    cfg,
    cluster,
    mesh: Mesh,
    layer: Layer,
    remat: str,
    batch: int,
    seq: int,
    context_attention: str = "ring",
    context_kv: str = "full",
) -> tuple[dict, float]:
    """({(class, direction, kind): [count, elements]} per layer, the 2-layer program's bytes), and
    the peak memory per device of the float32 program."""
    modes = dict(context_attention=context_attention, context_kv=context_kv)
    opts = Options(
        batch=batch,
        seq=seq,
        check_memory=False,
        act_bytes=ACT_BYTES,
        attention=cpu_attention(cfg, seq, mesh.context) if mesh.context > 1 else "auto",
    )
    plan = plan_for(cfg, cluster, mesh, 1, remat, layer, opts, flops_per_token=0.0, **modes)
    whole = sum(_bytes(c.axis, c.elements) for c in plan.rest_colls + 2 * (plan.layer_colls + plan.redo_colls))
    f32 = Options(
        batch=batch, seq=seq, check_memory=False, act_bytes=4, attention=cpu_attention(cfg, seq, mesh.context)
    )
    memory = plan_for(cfg, cluster, mesh, 1, remat, layer, f32, flops_per_token=0.0, **modes).memory["total"]
    return {"layer": _by_class(plan.layer_colls, plan.redo_colls), "whole": whole}, memory


def measured(
    cfg,
    mesh: Mesh,
    strategy: str,
    sequence_parallel: bool,
    remat: str,
    batch: int,
    seq: int,
    partition: str = "",
    memory: bool = False,
    context_attention: str = "ring",
    context_kv: str = "full",
) -> tuple[dict, float | None]:
    """The same from comm_report (compiled in COMPILE_DTYPE; bytes from elements as above)."""
    cfg = cfg.copy_and_resolve_references()
    cfg.parallel.update(sequence_parallel=sequence_parallel, linear_partition=partition)
    if mesh.context > 1:
        cfg.model.attention = cpu_attention(cfg, seq, mesh.context)
    label = f"{strategy}:{cfg.model.linear}"  # explicit linear: a bare name may mean another kind (report_linear)
    rep = report(
        cfg,
        mesh=(mesh.data, mesh.fsdp, mesh.tensor),
        strategies=label,
        batch=batch,
        seq=seq,
        dtype=COMPILE_DTYPE,
        memory=memory,
        programs=("forward", "forward_backward"),
        remat=remat,
        context=mesh.context,
        context_attention=context_attention,
        context_kv=context_kv,
    )
    col = rep["strategies"][label]
    fwd, fb = col["programs"]["forward"], col["programs"]["forward_backward"]
    layer: dict = {}
    for key in set(fwd["per_layer"]) | set(fb["per_layer"]):
        if _moves_nothing(key):
            continue
        kind, axis = key.split("@")[0], axis_group(key)
        f, b = fwd["per_layer"].get(key, {}), fb["per_layer"].get(key, {})
        parts = (("fwd", f), ("bwd", None)) if axis == "tensor" else (("fwd+bwd", None),)
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
    whole = sum(_bytes(axis_group(k), v["elements"]) for k, v in fb["rest"].items() if not _moves_nothing(k)) + 2 * sum(
        _bytes(axis_group(k), v["elements"]) for k, v in fb["per_layer"].items() if not _moves_nothing(k)
    )
    peak = col["memory"]["total_bytes"] if memory and col.get("memory") else None
    return {"layer": layer, "whole": whole}, peak


# Under context with data or fsdp, XLA folds part of the gradient's reduction over `context` into the
# one over data/fsdp (one all-reduce over both axes: at 2 x 2 x 2, the normed groups' A's and the
# norms); the planner prices the two reductions apart, an upper bound.
BOUND_TOLERANCE = 0.20


def _bound(row: dict) -> dict:
    """A row the planner bounds from above: ok when measured <= predicted <= (1 + BOUND_TOLERANCE) x measured."""
    p, m = row["predicted"], row["measured"]
    return {
        **row,
        "traffic": row["traffic"] + " (upper bound under context)",
        "ok": row["ok"] or m <= p <= (1 + BOUND_TOLERANCE) * m,
    }


def _moves_nothing(key: str) -> bool:
    """A comm_report key over no mesh axis: every group a single device (nothing moves)."""
    return key.split("@")[1] in ("", "none")


def _row(name: str, p: float, m: float, tolerance: float, counts=None) -> dict:
    ok = abs(p - m) <= tolerance * max(p, m)
    row = {
        "traffic": name,
        "predicted": p,
        "measured": m,
        "ratio": p / m if m else float(p == 0),
        "ok": ok,
        "counts": counts,
    }
    if counts is not None:
        pc, mc = counts
        combined = name.endswith("all-reduce") and mc < pc  # XLA's all-reduce combiner (see the docstring)
        row["ok"] = ok and (abs(pc - mc) <= tolerance * max(pc, mc) or combined)
        row["combined"] = combined
    return row


def uniform_layer(cfg, strategy: str, sequence_parallel: bool = False) -> Layer:
    """The layer a trainer strategy runs for this config's model (its kind factored or not, and
    parallel.online_norm): uniform_plan's."""
    b = Block.from_config(cfg)
    return Layer(*uniform_plan(strategy, sequence_parallel, factored=b.factored, online_norm=b.online_norm))


def on_cpu(cfg):
    """cfg as its CPU compile resolves the norm kernel (`auto`: XLA's norm on CPUs, model/autos.py), so
    the prediction prices the program the emulated devices compile (the planner otherwise prices a
    GPU cluster's fused norm)."""
    if cfg.kernels.rmsnorm != "auto":
        return cfg
    cfg = cfg.copy_and_resolve_references()
    cfg.kernels.rmsnorm = "xla"
    return cfg


def compare(
    cfg,
    cluster,
    mesh: Mesh,
    strategy: str,
    sequence_parallel: bool = False,
    remat: str = "none",
    batch: int = 2,
    seq: int = 64,
    layer: Layer | None = None,
    memory: bool = False,
    context_attention: str = "ring",
    context_kv: str = "full",
) -> list[dict]:
    """One row per traffic class and kind: predicted and measured bytes (and counts) per layer per
    device, whether they agree within TOLERANCE; data/fsdp bytes; the whole 2-layer program; with
    `memory`, the peak memory per device within MEMORY_TOLERANCE. `layer`: the plan's layer
    (default: the strategy's uniform one); its st groups run as parallel.linear_partition on the
    fsdp x tensor grid (fsdp == tensor). mesh.context > 1: the plan's context_attention and
    context_kv, the exchange compared as the `context` class."""
    cfg = on_cpu(cfg)
    layer = layer or uniform_layer(cfg, strategy, sequence_parallel)
    modes = dict(context_attention=context_attention, context_kv=context_kv)
    pred, pred_memory = predicted(cfg, cluster, mesh, layer, remat, batch, seq, **modes)
    meas, meas_memory = measured(
        cfg, mesh, strategy, sequence_parallel, remat, batch, seq, linear_partition(layer), memory, **modes
    )
    rows = []
    for axis, direction in CLASSES:
        keys = sorted({k for k in list(pred["layer"]) + list(meas["layer"]) if k[:2] == (axis, direction)})
        for key in keys:
            (pc, pe), (mc, me) = pred["layer"].get(key, (0, 0.0)), meas["layer"].get(key, (0, 0.0))
            rows.append(_row(f"{axis} {direction}: {key[2]}", _bytes(axis, pe), _bytes(axis, me), TOLERANCE, (pc, mc)))
    data = [sum(_bytes(k[0], v[1]) for k, v in d["layer"].items() if k[0] == "data_fsdp") for d in (pred, meas)]
    bound = mesh.context > 1 and mesh.data * mesh.fsdp > 1
    if any(data):
        rows.append(
            _bound(_row("data/fsdp fwd+bwd", *data, TOLERANCE))
            if bound
            else _row("data/fsdp fwd+bwd", *data, TOLERANCE)
        )
    rows.append(
        _bound(_row(WHOLE, pred["whole"], meas["whole"], TOLERANCE))
        if bound
        else _row(WHOLE, pred["whole"], meas["whole"], TOLERANCE)
    )
    if memory:
        rows.append(_row(MEMORY, pred_memory, meas_memory, MEMORY_TOLERANCE))
    return rows


# ---------------------------------------------------------------- pipelined plans

SCALAR = 32  # collectives of at most this many elements (the loss's and the gradient norm's scalars)
PIPELINE_CLASSES = ("pipeline", "pipeline weights", "tensor", "grid", "data/fsdp")
BYTES_ONLY = ("pipeline weights", "data/fsdp")  # XLA issues one collective per parameter array there


def pipeline_refusal(plan) -> str:
    """Why --verify does not compare this pipelined plan ("" when it does): what the compiled step
    does there that the planner does not price (seen at the test shapes). GPipe and circular plans
    (stage remat included) are compared."""
    if ST in plan.layer.choices:
        return (
            "pipelined st plans are not compared: XLA hoists the st weights' loop-invariant grid moves out of "
            "the tick loop, which the planner prices per tick"
        )
    if plan.layer.residual != "H" and plan.mesh.tensor > 1:
        return (
            f"pipelined plans with a {plan.layer.residual} residual ({plan.strategy or 'mixed'}) are not "
            "compared: the compiled step moves the embedding's rows over pipeline x data, which the planner "
            "does not price"
        )
    return ""


def verify_repeats(plan) -> int:
    """V to compile a circular plan at on 2 stages: 2 where the plan's reorder is an all-to-all (its
    V and S divide one another), else 3 (XLA gathers the stack; see outside_stack.circular_reorder)."""
    s, v = plan.mesh.pipeline, plan.repeats
    return 2 if v % s == 0 or s % v == 0 else 3


def shrink_pipeline(mesh: Mesh, seq: int, max_devices: int = MAX_DEVICES, grid: bool = False) -> tuple[Mesh, int]:
    """(mesh, seq) to verify a pipelined plan on: 2 stages, then as `shrink` within what is left
    (`grid`: st groups, the fsdp x tensor grid kept whole, up to MAX_GRID_DEVICES in all)."""
    inner, _, seq = shrink(
        Mesh(mesh.data, mesh.fsdp, mesh.tensor), seq, (MAX_GRID_DEVICES if grid else max_devices) // 2, grid=grid
    )
    if grid and 2 * inner.devices > MAX_GRID_DEVICES:
        raise ValueError(
            f"a pipelined st plan on a {inner.tensor} x {inner.tensor} grid needs "
            f"{2 * inner.devices} devices with 2 stages; --verify emulates at most {MAX_GRID_DEVICES}"
        )
    return Mesh(inner.data, inner.fsdp, inner.tensor, pipeline=2), seq


def _pipeline_class(axes, kind: str) -> str:
    axes = set(axes)
    if "pipeline" in axes:  # the circular schedule's weight moves: all-to-alls (V 3 on 2 stages: all-gathers)
        return "pipeline weights" if kind in ("all-to-all", "all-gather") or axes & {"data", "fsdp"} else "pipeline"
    if {"data", "fsdp"} & axes:
        return "grid" if axes == {"fsdp", "tensor"} else "data/fsdp"
    return "tensor"


def pipeline_config(
    cfg,
    mesh: Mesh,
    strategy: str,
    sequence_parallel: bool,
    remat: str,
    microbatches: int,
    seq: int,
    layer: Layer,
    schedule: str,
    repeats: int,
    stage_remat: str,
    layers_per_chunk: int,
):
    """(config, batch) the pipelined plan is compiled at: S x V x layers_per_chunk layers, one row per
    micro-batch per data x fsdp shard, the plan's schedule, remat and st groups."""
    batch = mesh.data * mesh.fsdp * microbatches
    c = variant_config(
        cfg, strategy, cfg.model.linear, (mesh.data, mesh.fsdp, mesh.tensor), batch, seq, COMPILE_DTYPE, remat
    )
    c.model.n_layers = mesh.pipeline * repeats * layers_per_chunk
    c.parallel.update(
        pipeline=mesh.pipeline,
        num_devices=mesh.devices,
        microbatches=microbatches,
        sequence_parallel=sequence_parallel,
        linear_partition=linear_partition(layer),
    )
    if schedule != "gpipe" or repeats != 1:
        c.parallel.update(pipeline_schedule=schedule, pipeline_repeats=repeats)
    c.remat.pipeline = stage_remat
    return c, batch


def measured_pipeline(c) -> tuple[dict, dict]:
    """({class: {kind: [executions, elements]}} of the compiled train step (the trainer's program: the
    tick loop scanned, each collective counted once per trip), its memory_analysis)."""
    compiled, mesh, _ = compile_program(
        c, "train_step", pick_devices(int(c.parallel.num_devices)), int(c.model.n_layers), unroll=False
    )
    out: dict = {}
    for col in parse_collectives(compiled.as_text(), mesh):
        if col.elements <= SCALAR:
            continue
        if col.trips is None:
            raise ValueError(f"a {col.kind} runs in a loop without a known trip count")
        trips = _executions(col, c)
        slot = out.setdefault(_pipeline_class(col.axes, col.kind), {}).setdefault(col.kind, [0, 0])
        slot[0] += trips
        slot[1] += col.elements * trips
    return out, memory_breakdown(compiled)


_TICK_BRANCHES = re.compile(r"shard_map/while/body/(?:closed_call/)?((?:cond/branch_\d+_fun/)+)")


def _executions(col, c) -> int:
    """How often a collective of the compiled step runs. 1F1B's tick loop (parallel/pipeline/one_f_one_b.py) runs its
    forward and backward in `lax.cond` branches a stage takes V M of the V M + V S + S - 2 ticks, and
    the head (a branch in the forward's) M of them at the last stage: the HLO's trip count is the
    ticks', so a collective in those branches is counted by the branch's runs (the last stage's)."""
    p = c.parallel
    branch = _TICK_BRANCHES.search(col.op_name) if p.pipeline_schedule == "1f1b" else None
    if branch is None:
        return col.trips
    stages, m, v = int(p.pipeline), int(p.microbatches), int(p.pipeline_repeats)
    ticks = ticks_1f1b(stages, m, v)
    runs = m * v if branch.group(1).count("cond/") == 1 else m
    return col.trips // ticks * runs


def predicted_pipeline(plan) -> dict:
    """{class: {kind: [executions, elements]}} of one accumulation micro-batch of a pipelined plan."""
    out: dict = {}
    for c, times in plan.step_colls:
        if c.elements <= SCALAR or not times:
            continue
        cls = {"data_fsdp": "data/fsdp", "pipeline_weights": "pipeline weights"}.get(c.axis, c.axis)
        slot = out.setdefault(cls, {}).setdefault(c.kind, [0, 0.0])
        slot[0] += times
        slot[1] += times * c.elements
    return out


def compare_pipeline(
    cfg,
    cluster,
    mesh: Mesh,
    strategy: str,
    sequence_parallel: bool = False,
    remat: str = "none",
    microbatches: int = 0,
    seq: int = 64,
    layer: Layer | None = None,
    schedule: str = "gpipe",
    repeats: int = 1,
    stage_remat: str = "none",
    layers_per_chunk: int = 1,
    memory: bool = True,
) -> list[dict]:
    """A pipelined plan's whole-step collectives by traffic class (pipeline / tensor / st grid) and kind
    (executions and bytes within TOLERANCE; data/fsdp bytes only, XLA gathers per parameter) and its
    peak memory per device (MEMORY_TOLERANCE), against the compiled train step: the trainer's program
    with its tick loop scanned, each collective counted once per loop trip, memory from
    memory_analysis() in float32. Collectives of at most SCALAR elements (the loss's and the gradient
    norm's scalars) are left out on both sides."""
    cfg = on_cpu(cfg)
    m = microbatches or 2 * mesh.pipeline
    if layer is None:
        layer = (
            uniform_layer(cfg, strategy, sequence_parallel)
            if mesh.tensor > 1
            else Layer("R", ("none",) * len(PROJECTION_GROUPS), "R", "R")
        )
    c, batch = pipeline_config(
        cfg, mesh, strategy, sequence_parallel, remat, m, seq, layer, schedule, repeats, stage_remat, layers_per_chunk
    )
    kw = dict(flops_per_token=0.0, microbatches=m, schedule=schedule, repeats=repeats, stage_remat=stage_remat)
    plan = plan_for(
        c, cluster, mesh, 1, remat, layer, Options(batch=batch, seq=seq, check_memory=False, act_bytes=ACT_BYTES), **kw
    )
    pred = predicted_pipeline(plan)
    meas, mem = measured_pipeline(c)
    rows = []
    for cls in PIPELINE_CLASSES:
        p, q = pred.get(cls, {}), meas.get(cls, {})
        if cls in BYTES_ONLY:
            pe, qe = (sum(v[1] for v in d.values()) for d in (p, q))
            if pe or qe:
                rows.append(_row(f"{cls} (whole step)", _bytes("data_fsdp", pe), _bytes("data_fsdp", qe), TOLERANCE))
            continue
        for kind in sorted(set(p) | set(q)):
            (pc, pe), (qc, qe) = p.get(kind, (0, 0.0)), q.get(kind, (0, 0.0))
            rows.append(_row(f"{cls} (whole step): {kind}", pe * ACT_BYTES, qe * ACT_BYTES, TOLERANCE, (pc, qc)))
    if memory:
        f32 = Options(batch=batch, seq=seq, check_memory=False, act_bytes=4, attention=cpu_attention(c, seq))
        predicted_memory = plan_for(c, cluster, mesh, 1, remat, layer, f32, **kw).memory["total"]
        rows.append(_row(MEMORY, predicted_memory, mem["total_bytes"], MEMORY_TOLERANCE))
    return rows
