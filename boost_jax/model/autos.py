"""What `auto` resolves to: the config fields whose fastest value depends on the devices and the mesh.

    picks = chosen(cfg, mesh)    # {field: value} of the autos alone (the start-up line prints them)
    cfg = apply(cfg, picks)      # a copy with every `auto` below replaced by its value here

runtime/build.py resolves every config it builds, once, and what it builds reads the result (a model
built directly, e.g. by a test, resolves through `for_model`), so the trainer, the tools, the
planner's `--verify` and the benchmarks run the same program for the same config and mesh. The rules
(`pick`) are each field's reasons, measured on one H100 (benchmarks/RESULTS.md, 2026-11-27 (sixth)
and 2026-11-28): model.group_linears, model.scan_unroll and remat.policy follow the mesh's splits and
the linear kind; kernels.rmsnorm is kernels/norm_choice.py's kernel. A value other than `auto` is
kept as given.
"""

from __future__ import annotations

import importlib.util

from boost_jax.kernels import platform
from boost_jax.kernels.norm_choice import choose_norm
from boost_jax.model.kinds import kind_class
from boost_jax.parallel.mesh import AXES, mesh_shape
from boost_jax.parallel.unroll import unrolls

AUTO = "auto"
FIELDS = ("model.group_linears", "model.scan_unroll", "remat.policy", "kernels.rmsnorm", "model.gate_kernel")


def _sizes(cfg, mesh) -> dict[str, int]:
    if mesh is None:
        return {a: 1 for a in AXES}
    if hasattr(mesh, "shape") and isinstance(mesh.shape, dict):
        return {a: int(mesh.shape.get(a, 1)) for a in AXES}
    return dict(zip(AXES, mesh_shape(cfg.parallel, int(mesh))))


def triton_available() -> bool:
    """jax-triton and triton import here (the fused Triton norm can be built for an NVIDIA GPU)."""
    return all(importlib.util.find_spec(m) is not None for m in ("triton", "jax_triton"))


# The rules' reasons (their measurements: benchmarks/RESULTS.md 2026-11-27 (sixth), "the one-device
# step at the defaults' speed", and 2026-11-28):
# - model.group_linears: grouped where the tensor axis splits the projections (grouping exists to merge
#   their collectives) and for unfactored kinds (dense: q/k/v and gate/up as one GEMM); factored kinds
#   otherwise `first` on GPUs: the A's as one GEMM (the backward's input gradient one GEMM, not a sum
#   of one per projection), each B its own (the B outputs sliced out of one batched GEMM cost more than
#   they save); ungrouped on CPUs.
# - model.scan_unroll: the layer stack unrolled on GPUs where only `data` splits the mesh (each device
#   runs the one-device program): XLA fuses and schedules across layers and no per-layer slices and
#   stacked gradient updates remain. Where the tensor axis splits the layers too (and only data
#   besides), the stack is unrolled when remat.policy is `none`: the scan would keep the same
#   activations and copy them into and out of its stacks besides; with a remat policy it keeps the
#   scan, which then recomputes. Pipeline, fsdp and context splits keep the scan (bounded per-layer
#   gathers, stages and ring blocks). The planner prices both stacks where auto unrolls (search_space.py).
# - remat.policy: an unrolled stack keeps every activation (`none`: XLA would fold a policy's
#   recompute back into the forward anyway); a scanned stack on a GPU recomputes: `lowrank` for
#   factored kinds, `full` for dense ones; CPUs keep everything (`none`).
# - kernels.rmsnorm: the fused Triton kernel on NVIDIA GPUs when jax-triton is installed, else the
#   fused Pallas kernel on GPUs; XLA's norm elsewhere (kernels/norm_choice.py). Where the trainer vmaps
#   the model the kernels are batched by kernels/row_batching.py.
# - model.gate_kernel: the Pallas gate·up kernel on GPUs where the gate and up outputs are separate
#   GEMMs' (a factored kind whose B's are not grouped): the backward's two gradients in one pass
#   (benchmarks/RESULTS.md 2026-11-28, "the gate product in one kernel each way"), and `gemm` (the product
#   inside the down projection's first GEMM, kernels/gated_gemm.py; 2026-11-29) where that kind adds no
#   term from its input (sltrain's does: pallas); where a dense kind's gate/up (or grouped B's) run as one
#   GEMM, XLA's product reads and writes the grouped output in place.
def pick(
    *, group, unroll, policy, norm, linear: str, gpu: bool, sizes: dict[str, int], triton: bool, gate=AUTO
) -> dict:
    """{"group_linears", "scan_unroll", "remat", "rmsnorm", "gate_kernel"}: each given value, or its rule's
    value where it is `auto`, on a GPU (or not) with mesh `sizes` (axis -> size)."""
    sizes = {a: int(sizes.get(a, 1)) for a in AXES}
    if unroll == AUTO:
        split = {a for a in AXES if sizes[a] > 1}
        unroll = gpu and unrolls(split, policy)
    if group == AUTO:
        factored = kind_class(linear).factored
        group = True if sizes["tensor"] > 1 or not factored else ("first" if gpu else False)
    if policy == AUTO:
        policy = "none" if unroll or not gpu else ("lowrank" if kind_class(linear).factored else "full")
    norm = choose_norm(norm, gpu=gpu, triton=triton).kernel  # the kernel part of the norm choice
    if gate == AUTO:
        kind = kind_class(linear)
        gate = "xla" if not (gpu and kind.factored and group is not True) else "pallas" if kind.has_extra else "gemm"
    return {
        "group_linears": group if group == "first" else bool(group),
        "scan_unroll": bool(unroll),
        "remat": policy,
        "rmsnorm": norm,
        "gate_kernel": gate,
    }


def rules(cfg, gpu: bool, sizes: dict[str, int], triton: bool) -> dict:
    """{field: value} for each FIELDS entry set to `auto` in cfg, on a GPU (or not) with mesh `sizes`."""
    m = cfg.model
    gate = m.get("gate_kernel", AUTO)
    values = pick(
        group=m.group_linears,
        unroll=m.scan_unroll,
        policy=cfg.remat.policy,
        norm=cfg.kernels.rmsnorm,
        linear=m.linear,
        gpu=gpu,
        sizes=sizes,
        triton=triton,
        gate=gate,
    )
    given = dict(zip(FIELDS, (m.group_linears, m.scan_unroll, cfg.remat.policy, cfg.kernels.rmsnorm, gate)))
    return {
        field: values[name]
        for field, name in zip(FIELDS, ("group_linears", "scan_unroll", "remat", "rmsnorm", "gate_kernel"))
        if given[field] == AUTO
    }


def chosen(cfg, mesh=None, devices=None) -> dict:
    """{field: value} that `auto` resolves to for cfg on `mesh` (a Mesh, or a device count with
    cfg.parallel's sizes), built for `devices` (default: the mesh's, else JAX's default backend)."""
    dev = platform.first_device(devices if devices is not None else mesh if hasattr(mesh, "devices") else None)
    gpu = (platform.of(dev) if dev is not None else platform.name()) == "gpu"
    return rules(cfg, gpu, _sizes(cfg, mesh), gpu and triton_available())


def apply(cfg, picks: dict):
    """A copy of cfg with `picks` ({field: value}, from `chosen`) set; cfg itself when there are none."""
    if not picks:
        return cfg
    cfg = cfg.copy_and_resolve_references()
    with cfg.unlocked(), cfg.ignore_type():  # a copy drops the fields' `auto | bool` references
        for key, value in picks.items():
            section, name = key.split(".")
            cfg[section][name] = value
    return cfg


def describe(picks: dict) -> str:
    """'group_linears false, scan_unroll true, ...' for a start-up line ('' when nothing was auto)."""
    short = {"remat.policy": "remat", "kernels.rmsnorm": "rmsnorm"}
    return ", ".join(f"{short.get(k, k.split('.')[1])} {str(v).lower()}" for k, v in picks.items())


def for_model(m, remat_policy: str, norm_impl: str, mesh=None):
    """(model section, remat policy, norm kernel) with what is left `auto` resolved for `mesh` (None: one
    device) on the target platform: a model built without runtime/build.py (tests, tools) follows the
    same rules. The model section is copied only when it changes."""
    gpu = platform.name() == "gpu"
    sizes = {a: int(v) for a, v in mesh.shape.items()} if mesh is not None else {}
    v = pick(
        group=m.group_linears,
        unroll=m.scan_unroll,
        policy=remat_policy,
        norm=norm_impl,
        linear=m.linear,
        gpu=gpu,
        sizes=sizes,
        triton=gpu and triton_available(),
        gate=m.get("gate_kernel", AUTO),
    )
    if AUTO in (m.group_linears, m.scan_unroll, m.get("gate_kernel", AUTO)):
        m = m.copy_and_resolve_references()
        with m.unlocked(), m.ignore_type():
            m.group_linears, m.scan_unroll = v["group_linears"], v["scan_unroll"]
            m.gate_kernel = v["gate_kernel"]
    return m, v["remat"], v["rmsnorm"]
