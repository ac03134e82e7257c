"""A step's kernels priced on a target GPU: the GPUs' numbers (`Target`), the constants fitted to
measured steps (`Costs`, targets/step_costs.json, benchmarks/step_profile_fit.py), each kernel's
time and the step's table by category (`price`, `profile`). A GEMM runs at max(FLOPs / (peak x the
efficiency of its shape class), bytes / bandwidth), priced by its shape (`gemm_class`), never by the
backend named (a deviceless compile has no GEMM autotuner); a Pallas/Triton kernel that names its GEMM
(kernels/priced.py) is such a GEMM and borrows its class's fitted efficiency (no constant of its own
until a measured row has one); attention at a fitted efficiency; the
rest at HBM bandwidth; a collective at its ring's bandwidth and latency, counted at its exposed part
(overlap.py; `no_overlap_step_s` adds them in full); every launch costs `launch_s`. The roofline
beside each category: each kernel at the GPU's dense bf16 peak or datasheet HBM bandwidth,
whichever binds (`roofline_time`), the collectives at link bandwidth times their exposed share.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from boost_jax.tools.step_profile.branches import skip_untaken
from boost_jax.tools.step_profile.categories import CATEGORIES
from boost_jax.tools.step_profile.kernels import Kernel, kernels
from boost_jax.tools.step_profile.overlap import exposure

COSTS_FILE = Path(__file__).parents[1] / "targets" / "step_costs.json"


@dataclass(frozen=True)
class Target:
    """A GPU's numbers: `hbm_bytes_per_s` the bandwidth a copy kernel reaches, `bf16_flops` the dense
    bf16 tensor-core peak (float32 operands run at half: TF32), `link_*` one GPU's NVLink bandwidth
    in a ring collective and its per-step latency, `node_*` the network's between nodes."""

    name: str
    hbm_bytes_per_s: float
    bf16_flops: float
    link_bytes_per_s: float
    link_latency_s: float
    node_bytes_per_s: float
    node_latency_s: float
    gpus_per_node: int = 8
    source: str = ""
    hbm_peak_bytes_per_s: float = 0.0  # the datasheet HBM bandwidth (the roofline's; 0: copy / COPY_SHARE)

    def hbm_peak(self) -> float:
        return self.hbm_peak_bytes_per_s or self.hbm_bytes_per_s / COPY_SHARE


# The H100's copy bandwidth is measured (benchmarks/gpu_bench.json, rmsnorm part, "copy (x + 1)" on
# [16384, 4096] bf16; benchmarks/RESULTS.md), a share of its datasheet figure; the other GPUs take the
# same share of their datasheet bandwidth. Peaks are datasheet dense bf16; link figures are those of
# configs/clusters (nccl-tests ring bandwidths).
COPY_SHARE = 2268.7e9 / 3.35e12
TARGETS = {
    "h100": Target(
        "h100",
        COPY_SHARE * 3.35e12,
        989e12,
        360e9,
        7e-6,
        40e9,
        15e-6,
        source="H100 SXM5 80GB: 3.35 TB/s HBM3, 989 TFLOP/s bf16, NVLink4 (configs/clusters/h100_8x.py)",
        hbm_peak_bytes_per_s=3.35e12,
    ),
    "h200": Target(
        "h200",
        COPY_SHARE * 4.8e12,
        989e12,
        360e9,
        7e-6,
        40e9,
        15e-6,
        source="H200 SXM 141GB: 4.8 TB/s HBM3e, 989 TFLOP/s bf16, NVLink4",
        hbm_peak_bytes_per_s=4.8e12,
    ),
    "a100": Target(
        "a100",
        COPY_SHARE * 2.039e12,
        312e12,
        230e9,
        10e-6,
        20e9,
        20e-6,
        source="A100 SXM4 80GB: 2.04 TB/s HBM2e, 312 TFLOP/s bf16, NVLink3 (configs/clusters/a100_4x.py)",
        hbm_peak_bytes_per_s=2.039e12,
    ),
    "a100_40gb": Target(
        "a100_40gb",
        COPY_SHARE * 1.555e12,
        312e12,
        230e9,
        10e-6,
        20e9,
        20e-6,
        # four a node, as the cluster the planner plans the 40 GB part on (configs/clusters/a100_4x.py)
        gpus_per_node=4,
        source="A100 SXM4 40GB: 1.56 TB/s HBM2, 312 TFLOP/s bf16, NVLink3, 4 GPUs a node",
        hbm_peak_bytes_per_s=1.555e12,
    ),
}

# GEMM shape classes, by the smallest of m, n and k (the dimension that limits a tile's reuse), and
# a batched GEMM (batch > 1: grouped projections) apart: the classes `Costs.gemm_efficiency` holds a
# fraction of peak for.
GEMM_CLASSES = ("large", "medium", "batched")
LARGE_DIM = 1024


def gemm_class(gemm: tuple) -> str:
    """The shape class of a GEMM (batch, m, n, k, dtype): `batched` when batch > 1, else `large` when
    min(m, n, k) > LARGE_DIM, `medium` otherwise (a bottleneck's rank, d/4: 512 on cola_1b, 1024 on
    cola_7b)."""
    if not gemm:
        return "medium"
    batch, m, n, k = gemm[:4]
    if batch > 1:
        return "batched"
    return "large" if min(m, n, k) > LARGE_DIM else "medium"


@dataclass(frozen=True)
class Costs:
    """The fitted constants: the fraction of peak a GEMM reaches per shape class, cuDNN attention's
    fraction of peak, the time one kernel launch adds, and the share of XLA's rematerialized clones
    priced (`Kernel.remat_clone`; 0: none, see `remat_clone`)."""

    gemm_efficiency: dict
    attention_efficiency: float
    launch_s: float
    remat_clone_share: float = 0.0
    attention_half_keys: float = 0.0  # keys per row at which attention reaches half its efficiency (0: flat)
    fitted_on: tuple = ()
    note: str = ""


DEFAULT_COSTS = Costs(
    {"large": 0.75, "medium": 0.6, "batched": 0.6}, 0.4, 5e-6, note="unfitted defaults (datasheet-scale guesses)"
)


def costs(target: str) -> Costs:
    """The fitted Costs for `target` (boost_jax/tools/targets/step_costs.json, written by
    benchmarks/step_profile_fit.py); a target fitted on none takes the H100's fit, then the defaults."""
    try:
        table = json.loads(COSTS_FILE.read_text())
    except (OSError, ValueError):
        return DEFAULT_COSTS
    entry = table.get(target) or table.get("h100")
    if not entry:
        return DEFAULT_COSTS
    return Costs(
        dict(entry["gemm_efficiency"]),
        float(entry["attention_efficiency"]),
        float(entry["launch_s"]),
        float(entry.get("remat_clone_share", 0.0)),
        float(entry.get("attention_half_keys", 0.0)),
        tuple(entry.get("fitted_on", ())),
        entry.get("note", ""),
    )


def kernel_time(k: Kernel, target: Target, c: Costs) -> float:
    """Seconds one execution of kernel `k` takes on `target` (its launch apart)."""
    memory = k.bytes / target.hbm_bytes_per_s
    if k.kind == "collective":
        info = k.collective
        bw, lat = (
            (target.node_bytes_per_s, target.node_latency_s)
            if info.get("crosses_nodes")
            else (target.link_bytes_per_s, target.link_latency_s)
        )
        return info["wire_bytes"] / bw + info["steps"] * lat
    if k.kind == "gemm":
        peak = target.bf16_flops * (0.5 if k.gemm and k.gemm[4] in ("f32", "f64") else 1.0)
        return max(k.flops / (peak * c.gemm_efficiency[gemm_class(k.gemm)]), memory)
    if k.kind == "attention":
        return attention_time(k, target, c, memory)
    return memory


# cuDNN's flash backward on sm90 runs two passes beside its main kernel (seen in every H100/H200 trace,
# benchmarks/gpu_profile/): `compute_dot_do_o` reads O and dO (2 + 2 bytes per query element) and
# `convert_dq_to_16bits` reads the float32 dQ the main kernel accumulated and writes it in bf16 (4 written
# by the main kernel, 4 read, 2 written): bytes per element of Q ([batch, queries, heads, head dim]).
ATTENTION_BWD_SIDE_BYTES = 2 + 2 + 4 + 4 + 2


def attention_time(k: Kernel, target: Target, c: Costs, memory: float) -> float:
    """cuDNN attention: its FLOPs at a fraction of peak that grows with the keys per row,
    efficiency x keys / (keys + half_keys) (short rows keep the tensor cores less busy: the
    measured shares per row length are in benchmarks/RESULTS.md), plus the backward's side passes at
    the copy bandwidth."""
    eff = c.attention_efficiency
    side = 0.0
    if k.attention:
        b, h, sq, sk, d, backward, _ = k.attention
        if c.attention_half_keys:
            eff *= sk / (sk + c.attention_half_keys)
        if backward:
            side = ATTENTION_BWD_SIDE_BYTES * b * sq * h * d / target.hbm_bytes_per_s
    return max(k.flops / (target.bf16_flops * eff), memory) + side


def roofline_time(k: Kernel, target: Target) -> float:
    """Seconds one execution of `k` takes at the GPU's peaks, whichever binds: its FLOPs at the dense
    bf16 peak (float32 operands at half: TF32), its HBM bytes at the datasheet bandwidth; a collective
    its link bytes at the link bandwidth, no latency; a loop's predicate read-back nothing."""
    if k.kind == "sync":
        return 0.0
    if k.kind == "collective":
        bw = target.node_bytes_per_s if k.collective.get("crosses_nodes") else target.link_bytes_per_s
        return k.collective["wire_bytes"] / bw
    peak = target.bf16_flops * (0.5 if k.kind == "gemm" and k.gemm and k.gemm[4] in ("f32", "f64") else 1.0)
    return max(k.flops / peak, k.bytes / target.hbm_peak())


def price(ks: list[Kernel], target: str | Target = "h100", c: Costs | None = None) -> dict:
    """Each kernel's time on `target`; the step's time by category (seconds; `launch` = launches x
    `launch_s`; a loop's predicate read-back counts as a launch); the step's time the sum of all, the
    collectives at their exposed part (`overlap.exposure`: what the compute scheduled beside them
    does not hide; "no_overlap_step_s" adds them in full, the bound without overlap). XLA's
    rematerialized clones count `remat_clone_share` of their time and launches; "remat_clones" says
    what they would add in full. The roofline (`roofline_time`) by category and for the step, the
    collectives' at their exposed share. Each conditional runs its costliest branch (branches.py):
    the others' kernels are `skipped`, their time "untaken_branches_s"."""
    t = TARGETS[target] if isinstance(target, str) else target
    c = c or costs(t.name)
    by = dict.fromkeys(CATEGORIES, 0.0)
    roof = dict.fromkeys(CATEGORIES, 0.0)
    n = 0.0
    clones = {"kernels": 0, "launches": 0, "time_s": 0.0}
    for k in ks:
        k.time_s = kernel_time(k, t, c)
    untaken = skip_untaken(
        ks, lambda k: (c.remat_clone_share if k.remat_clone else 1.0) * k.count * (k.time_s + c.launch_s)
    )
    ks = [k for k in ks if not k.skipped]
    for k in ks:
        share = c.remat_clone_share if k.remat_clone else 1.0
        by[k.category] += share * k.total_s()
        if k.kind != "collective":
            roof[k.category] += share * roofline_time(k, t) * k.count
        n += share * k.count
        if k.remat_clone:
            clones["kernels"] += 1
            clones["launches"] += k.count
            clones["time_s"] += k.total_s() + k.count * c.launch_s
    by["launch"] += n * c.launch_s
    coll = collectives(ks, t, c.remat_clone_share)
    no_overlap = sum(by.values())
    by["collectives"] += coll["exposed_s"] - coll["priced_s"]
    roof["collectives"] += coll["roofline_exposed_s"]
    return {
        "target": t.name,
        "predicted_step_s": sum(by.values()),
        "no_overlap_step_s": no_overlap,
        "time_by_category": by,
        "roofline_step_s": sum(roof.values()),
        "roofline_by_category": roof,
        "collectives": coll,
        "launches": int(round(n)),
        "remat_clones": clones,
        "remat_clone_share": c.remat_clone_share,
        "untaken_branches_s": untaken,
        "costs": asdict(c),
    }


def collectives(ks: list[Kernel], t: Target, share: float = 1.0) -> dict:
    """The priced collectives' overlap with compute (overlap.exposure): per step, "priced_s",
    "overlapped_s", "exposed_s", their roofline in full and at each one's exposed share, and
    "by_kernel" (each collective: name, kind, runs per step, async or not, seconds priced and
    exposed, source), the costliest exposed first."""
    rows = exposure(ks, share)
    total = {key: sum(r[key] for r in rows) for key in ("priced_s", "overlapped_s", "exposed_s")}
    roof = [r["weight"] * roofline_time(r["kernel"], t) * r["kernel"].count for r in rows]
    return {
        **total,
        "roofline_s": sum(roof),
        "roofline_exposed_s": sum(f * r["exposed_s"] / r["priced_s"] for f, r in zip(roof, rows) if r["priced_s"]),
        "by_kernel": [
            {
                "name": r["kernel"].name,
                "kind": r["kernel"].collective["kind"],
                "count": r["kernel"].count,
                "async": r["kernel"].window is not None,
                "priced_s": r["priced_s"],
                "exposed_s": r["exposed_s"],
                "source": r["kernel"].source,
            }
            for r in sorted(rows, key=lambda r: -r["exposed_s"])
        ],
    }


def summary(ks: list[Kernel], priced: dict, top: int = 15) -> dict:
    """The JSON of a priced program: step time, time by category, launches, FLOPs and bytes per
    category (HBM traffic; for collectives the bytes over the links) and the `top` kernels by time."""
    ks = [k for k in ks if not k.skipped]  # a conditional's untaken branches (price)
    flops = dict.fromkeys(CATEGORIES, 0.0)
    hbm = dict.fromkeys(CATEGORIES, 0.0)
    kcount = dict.fromkeys(CATEGORIES, 0)
    share = priced.get("remat_clone_share", 0.0)
    for k in ks:
        w = share if k.remat_clone else 1.0
        flops[k.category] += w * k.flops * k.count
        hbm[k.category] += w * _moved(k) * k.count
        kcount[k.category] += int(round(w * k.count))
    ranked = sorted((k for k in ks if share or not k.remat_clone), key=lambda k: -k.total_s())[:top]
    return {
        **priced,
        "kernels_per_step": kcount,
        "flops_by_category": flops,
        "bytes_by_category": hbm,
        "gemm_flops_by_class": _by_class(ks),
        "top_kernels": [
            {
                "name": k.name,
                "category": k.category,
                "kind": k.kind,
                "count": k.count,
                "time_s": k.total_s(),
                "flops": k.flops * k.count,
                "bytes": _moved(k) * k.count,
                "gemm": list(k.gemm),
                "backend": k.backend,
                "source": k.source,
            }
            for k in ranked
        ],
    }


def _moved(k: Kernel) -> float:
    """Bytes a kernel moves per execution: HBM traffic, or for a collective what its ring sends."""
    return k.collective.get("wire_bytes", 0.0) if k.kind == "collective" else k.bytes


def _by_class(ks: list[Kernel]) -> dict:
    out = dict.fromkeys(GEMM_CLASSES, 0.0)
    for k in ks:
        if k.kind == "gemm":
            out[gemm_class(k.gemm)] += k.flops * k.count
    return out


def profile(
    hlo_text: str, target: str = "h100", accumulation: int = 1, mesh=None, top: int = 15, c: Costs | None = None
) -> dict:
    """The step-time table of one compiled GPU program (see `summary`)."""
    t = TARGETS[target]
    ks = kernels(hlo_text, accumulation, mesh, t.gpus_per_node)
    return summary(ks, price(ks, t, c), top)
