"""Compile the real train step (and eval step) for GPUs this host does not have, and say whether it fits.

    python -m boost_jax.tools.aot --target h100 --devices 8 --config configs/cola_7b.py --mesh 1,1,1,8

XLA compiles for a GPU without one ("deviceless AOT"): the devices come from a target config
(`targets/NAME.txtpb`: cores, memory, compute capability), the steps are the trainer's own
(`runtime/build.py`), so the model, kernels and XLA flags take their GPU paths (`kernels/platform.py`).
Printed per device: argument / output / temp / peak bytes and whether the peak fits the GPU's memory
times `--usable`, the GPU kernels, the collectives per step and the compile time. A deviceless
compile's memory, kernels and collective schedule are the GPU's, its run-time estimates are not (no
GEMM autotuning), so `--profile` prices the train step's kernels instead (tools/step_profile/).
Needs the `aot` extra (jax's CUDA plugin and the NVIDIA compilers as wheels; no GPU, driver or CUDA
toolkit). Nothing here imports jax at module level.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import re
import sys
import time
from collections import Counter
from pathlib import Path

from boost_jax.config import config_path, load_config_file
from boost_jax.errors import ConfigError, install_hint
from boost_jax.parallel.grad_reduce import loop_trips
from boost_jax.tools.comm_report.tallies import itemsize
from boost_jax.tools.devices import mesh_fields, parse_mesh
from boost_jax.tools.hlo_comm import parse_collectives
from boost_jax.tools.progress import ticking
from boost_jax.tools.step_profile import command as step_command
from boost_jax.tools.step_profile import pricing as step_pricing

TARGETS_DIR = Path(__file__).with_name("targets")
INSTALL = install_hint("aot")  # for how this package was installed
USABLE = 0.9  # share of a GPU's memory a run may allocate (XLA_PYTHON_CLIENT_MEM_FRACTION=0.9)
# (distribution, what it brings): jax's CUDA plugin, ptxas, libdevice, and cuDNN (jax checks its version)
_NEEDED = (
    ("jax-cuda13-plugin", "jax's CUDA plugin"),
    ("jax-cuda13-pjrt", "jax's CUDA PJRT"),
    ("nvidia-cuda-nvcc", "ptxas"),
    ("nvidia-nvvm", "libdevice"),
    ("nvidia-cudnn-cu13", "cuDNN"),
)


class AotError(SystemExit):
    """A one-line error of this tool (exits 2 with the message)."""


def targets() -> list[str]:
    return sorted(p.stem for p in TARGETS_DIR.glob("*.txtpb"))


def target_config(name: str) -> str:
    path = TARGETS_DIR / f"{name}.txtpb"
    if not path.is_file():
        raise AotError(f"--target: unknown GPU {name!r}; one of {', '.join(targets())}")
    return path.read_text()


def target_memory(name: str) -> int:
    """The target GPU's memory in bytes, from its target config."""
    return int(re.search(r"device_memory_size:\s*(\d+)", target_config(name)).group(1))


def missing() -> str:
    """What of the `aot` extra is not installed ('' when everything is)."""

    def found(dist):
        try:
            importlib.metadata.version(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            return False

    return ", ".join(f"{dist} ({what})" for dist, what in _NEEDED if not found(dist))


def available() -> bool:
    return not missing()


def require() -> None:
    gone = missing()
    if gone:
        raise AotError(f"compiling for a GPU without one needs the aot extra ({gone} missing): {INSTALL}")


def topology_string(n: int) -> str:
    """slices x hosts x devices per host: hosts of 8 GPUs beyond 8, as an HGX/DGX cluster has them."""
    if n > 8 and n % 8 == 0:
        return f"1x{n // 8}x8"
    return f"1x1x{n}"


_DEVICES: dict = {}
# XLA:GPU budgets its scheduler and its rematerialization with the module's device memory, less the
# program's arguments and outputs (gpu_hlo_schedule.cc GetSchedulerMemoryLimit). On a GPU, jaxlib
# passes the allocator's limit as that memory (XLA_PYTHON_CLIENT_MEM_FRACTION of the free memory,
# 0.9 by default); a deviceless compile has no allocator and XLA takes 80% of the target's memory,
# a tighter budget, under which XLA rematerializes kernels the GPU does not run (benchmarks/RESULTS.md
# has the kernels and traffic it added to llama_1b). `devices(..., gpu_budget=True)` describes the
# topology with memory USABLE / XLA_SHARE of the GPU's, so that XLA's share of it is the GPU's budget.
XLA_SHARE = 0.8


def budget_config(text: str, usable: float = USABLE) -> str:
    """A target config whose device memory makes XLA's deviceless budget the GPU's under `usable`."""
    memory = int(re.search(r"device_memory_size:\s*(\d+)", text).group(1))
    return re.sub(r"device_memory_size:\s*\d+", f"device_memory_size: {int(memory * usable / XLA_SHARE)}", text)


def devices(target: str, n: int, gpu_budget: bool = False, usable: float = USABLE) -> list:
    """n deviceless GPU devices of `target` (kept per process: a topology is made once); with
    `gpu_budget`, described so that XLA budgets memory as it does on the GPU whose runs may allocate
    `usable` of its memory (`budget_config`)."""
    require()
    text = budget_config(target_config(target), usable) if gpu_budget else target_config(target)
    key = (target, n, gpu_budget and usable)
    if key not in _DEVICES:
        import jax
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized():
            jax.config.update("jax_platforms", "cpu")  # no GPU here: the CUDA plugin must not try to start one
        from jax.experimental import topologies

        try:
            topo = topologies.get_topology_desc(platform="cuda", target_config=text, topology=topology_string(n))
        except Exception as e:  # noqa: BLE001 - the plugin's own words, on one line
            raise AotError(
                f"--target {target}: jax could not describe {n} GPUs "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); check `{INSTALL}`"
            ) from e
        _DEVICES[key] = list(topo.devices)
    return _DEVICES[key]


# ------------------------------------------------------------------------------- reading the program

_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
_TRITON_NAME = re.compile(r'\bname\s*=\s*"([^"]+)"|"name"\s*:\s*"([^"]+)"')
_MASK = re.compile(r'"mask_type"\s*:\s*"([A-Z_]+)"')
_FUSION_KIND = re.compile(r'"kind"\s*:\s*"(__triton[\w]*|__cudnn[\w$]*|__cublas[\w$]*)"')
_KERNEL_NAMES = {
    "__cublas$gemm": "cublas gemm",
    "__cublas$lt$matmul": "cublasLt matmul",
    "__triton_gemm": "triton gemm",
    "__triton_nested_gemm_fusion": "triton gemm",
    "__triton": "triton fusion",
    "__cudnn$fusion": "cudnn fusion",
}


def kernels(hlo_text: str) -> dict:
    """{kernel: count} of the GPU program's library calls and generated kernels, by what they run:
    cuDNN fused attention (`cudnn attention (fwd|bwd, MASK)`, MASK `causal`, or `padding_causal` with
    per-row lengths; any other cuDNN graph by its target),
    cuBLAS GEMMs, Triton GEMM/fusions XLA generated, Pallas kernels (`triton kernel NAME`, NAME the
    kernel's own) and jax-triton kernels (`triton kernel (jax-triton)`). Counted once per instruction
    (not per loop trip)."""
    counts: Counter = Counter()
    for line in hlo_text.splitlines():
        m = _CUSTOM_CALL.search(line)
        if m:
            target = m.group(1)
            if target.startswith("triton_kernel_call"):  # jax-triton: the kernel's name is in an opaque blob
                counts["triton kernel (jax-triton)"] += 1
            elif target == "__gpu$xla.gpu.triton":  # Pallas on Triton: the kernel names itself
                name = _TRITON_NAME.search(line)
                counts[f"triton kernel {(name.group(1) or name.group(2)) if name else '?'}"] += 1
            elif target.startswith("__cudnn$fmha"):  # with its mask: PADDING_CAUSAL takes per-row lengths
                kind = "bwd" if "Backward" in target else "fwd"
                mask = _MASK.search(line)
                counts[f"cudnn attention ({kind}, {mask.group(1).lower() if mask else 'no mask'})"] += 1
            else:
                counts[_KERNEL_NAMES.get(target, target)] += 1
            continue
        if " fusion(" in line:
            f = _FUSION_KIND.search(line)
            if f:
                counts[_KERNEL_NAMES.get(f.group(1), f.group(1))] += 1
    return dict(sorted(counts.items()))


def collectives(hlo_text: str, mesh, accumulation: int = 1) -> dict:
    """{kind: {"ops", "count", "elements", "bytes"}} per device and step: `ops` instructions in the
    program, `count` their executions (through the loops' trip counts; the one loop whose count the
    GPU step hides, its accumulation loop, runs `accumulation` times), `elements` and `bytes` what
    those executions move (bytes at the dtype the GPU program carries)."""
    out: dict = {}
    for c in parse_collectives(hlo_text, mesh, unknown_trips=accumulation):
        trips = c.trips or 1
        slot = out.setdefault(c.kind, {"ops": 0, "count": 0, "elements": 0, "bytes": 0})
        slot["ops"] += 1
        slot["count"] += trips
        slot["elements"] += c.elements * trips
        slot["bytes"] += int(c.elements * trips * itemsize(c.dtype))
    return dict(sorted(out.items()))


def peak_bytes(m) -> int:
    """A compiled program's peak per device from its memory_analysis(): arguments, outputs and
    temporaries, less the outputs that alias donated arguments."""
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def analyze(compiled, mesh, device_memory: int, usable: float = USABLE, accumulation: int = 1) -> dict:
    m = compiled.memory_analysis()
    arg, out, temp, alias = (
        m.argument_size_in_bytes,
        m.output_size_in_bytes,
        m.temp_size_in_bytes,
        m.alias_size_in_bytes,
    )
    peak = peak_bytes(m)
    limit = int(device_memory * usable)
    text = compiled.as_text()
    return {
        "peak_bytes": peak,
        "argument_bytes": arg,
        "output_bytes": out,
        "temp_bytes": temp,
        "alias_bytes": alias,
        "device_memory_bytes": device_memory,
        "usable_bytes": limit,
        "fits": peak <= limit,
        "headroom_bytes": limit - peak,
        "kernels": kernels(text),
        "collectives": collectives(text, mesh, accumulation),
    }


# ------------------------------------------------------------------------------------ compiling


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:300]}"


def resolved(cfg) -> dict:
    """The config fields `auto` decides (model/autos.py), as the built step has them."""
    from boost_jax.model.autos import FIELDS  # lazy: loads JAX, which aot must not import at load

    return {key: cfg[key.split(".")[0]][key.split(".")[1]] for key in FIELDS}


def compile_config(
    cfg,
    target: str,
    n_devices: int,
    *,
    programs=("train", "eval"),
    usable: float = USABLE,
    profile: bool = False,
    table: bool = False,
) -> dict:
    """Build `cfg` (its parallel.* mesh) on n deviceless `target` GPUs and compile its steps:
    {"target", "devices", "mesh", "train": analyze(...) + compile_s, "eval": ...}; with `profile`,
    "profile": the train step's time table (tools/step_profile/), the steps then compiled under the
    GPU's memory budget (`devices(gpu_budget=True)`: the program the GPU runs, whose memory can
    differ from the plain deviceless compile's where XLA rematerializes); with `table` (and not
    `profile`), the same table of the plain deviceless compile, at no extra compile."""
    from boost_jax.runtime.build import build  # lazy: loads JAX, which aot must not import at load

    cfg = cfg.copy_and_resolve_references()
    cfg.data.source = "embedded"  # nothing is read (the batch is abstract); a `tokens` source would need a path
    p = cfg.parallel
    sizes = {a: p[a] for a in ("pipeline", "data", "fsdp", "context", "tensor")}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if fixed > n_devices or (-1 not in sizes.values() and fixed != n_devices and not p.num_devices):
        raise AotError(
            f"--mesh: pipeline x data x fsdp x context x tensor = {fixed} devices but --devices {n_devices}; "
            "make them equal (or give one axis -1)"
        )
    devs = devices(target, n_devices, gpu_budget=profile, usable=usable)
    try:
        built = build(cfg, devs)
    except ConfigError as e:
        raise AotError(f"{e}") from e
    memory = target_memory(target)
    out = {
        "target": target,
        "device_kind": devs[0].device_kind,
        "devices": n_devices,
        "mesh": dict(built.mesh.shape),
        "resolved": resolved(built.cfg),
        "xla_budget": "gpu" if profile else "deviceless",
    }
    lower = {"train": built.lower_train, "eval": built.lower_eval}
    # The train step's accumulation loop trips (its count is hidden from XLA in the GPU program; the
    # first micro-batch may run before it); the eval step maps its slices as before.
    trips = {"train": loop_trips(int(cfg.train.grad_accum), built.mesh, built.strategy)}
    trips["eval"] = int(cfg.train.grad_accum)
    for program in programs:
        t0 = time.perf_counter()
        try:
            compiled = lower[program]().compile()
        except ConfigError as e:
            raise AotError(f"{e}") from e
        except NotImplementedError as e:  # jax's own refusals (cuDNN attention shapes, ...)
            raise AotError(
                f"config cannot compile for {target} ({_one_line(e)}): set model.attention "
                "(chunked or pallas) or kernels.* to a path that takes these shapes"
            ) from e
        except Exception as e:  # noqa: BLE001 - XLA's refusals, on one line
            raise AotError(f"config cannot compile its {program} step for {target}: {_one_line(e)}") from e
        out[program] = {
            **analyze(compiled, built.mesh, memory, usable, trips[program]),
            "compile_s": time.perf_counter() - t0,
        }
        if (profile or table) and program == "train":
            out["profile"] = step_pricing.profile(compiled.as_text(), target, trips[program], built.mesh)
    return out


# ---------------------------------------------------------------------------------- command line

GB = 1e9


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n / GB:.1f} GB)"


def to_text(rep: dict) -> str:
    lines = [
        f"{rep['devices']} x {rep['device_kind']} (deviceless), mesh "
        + " x ".join(f"{k} {v}" for k, v in rep["mesh"].items()),
        "built with " + ", ".join(f"{k}={str(v).lower()}" for k, v in rep.get("resolved", {}).items()),
    ]
    for program in ("train", "eval"):
        r = rep.get(program)
        if r is None:
            continue
        verdict = (
            f"fits, {_gib(r['headroom_bytes'])} to spare"
            if r["fits"]
            else f"does NOT fit: {_gib(-r['headroom_bytes'])} over"
        )
        lines += [
            f"{program} step (compiled in {r['compile_s']:.1f} s), per device:",
            f"  argument {_gib(r['argument_bytes'])}, output {_gib(r['output_bytes'])}, "
            f"temp {_gib(r['temp_bytes'])}, aliased {_gib(r['alias_bytes'])}",
            f"  peak {_gib(r['peak_bytes'])} of {_gib(r['usable_bytes'])} usable "
            f"({r['usable_bytes'] / r['device_memory_bytes']:.0%} of {_gib(r['device_memory_bytes'])}): "
            f"{verdict}",
            "  kernels: " + (", ".join(f"{k} x{v}" for k, v in r["kernels"].items()) or "none"),
            "  collectives per step: "
            + (
                ", ".join(
                    f"{k} {c['count']}x ({c['ops']} ops) {c['bytes'] / 2**20:.1f} MiB"
                    for k, c in r["collectives"].items()
                )
                or "none"
            ),
        ]
    if "profile" in rep:
        lines.append(step_command.to_text(rep["profile"], "train step time table: "))
    return "\n".join(lines)


def load(config: str, overrides: list[str]):
    """The config file with `--config.KEY=VALUE` overrides, parsed as the trainer parses them."""
    from absl import flags
    from ml_collections import config_flags

    config = config_path(config)  # a packaged config's name (cola_7b) as `train --config` takes it
    try:
        load_config_file(config, "--config", run_config=True)
    except FileNotFoundError as e:
        raise AotError(f"--config: no such file {config} (e.g. configs/cola_7b.py)") from e
    except ConfigError as e:
        raise AotError(str(e)) from e
    fv = flags.FlagValues()
    argv = ["aot", f"--config={config}", *overrides]
    try:
        config_flags.DEFINE_config_file("config", config, "run config", flag_values=fv, lock_config=True, sys_argv=argv)
        fv(argv)
        return fv.config
    except (AttributeError, KeyError, flags.Error) as e:
        why = e
        while isinstance(why, (AttributeError, KeyError)) and why.args:
            why = why.args[0]
        raise AotError(
            f"{' '.join(overrides)}: {str(why).splitlines()[0]} (the keys are those of boost_jax/config/schema.py)"
        ) from e


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    overrides = [a for a in argv if a.startswith("--config.")]
    rest = [a for a in argv if not a.startswith("--config.")]
    ap = argparse.ArgumentParser(
        prog="python -m boost_jax.tools.aot",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any --config.KEY=VALUE overrides the config, as for the trainer.",
    )
    ap.add_argument("--target", required=True, help=f"the GPU: {' | '.join(targets())}")
    ap.add_argument("--devices", type=int, required=True, help="how many GPUs (8 per host beyond 8)")
    ap.add_argument("--config", required=True, help="a configs/*.py file")
    ap.add_argument(
        "--mesh",
        help="pipeline,data,fsdp,tensor (or pipeline,data,fsdp,context,tensor) sizes "
        "(default: the config's parallel.*)",
    )
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument(
        "--usable",
        type=float,
        default=USABLE,
        help=f"share of the GPU's memory a run may use (default {USABLE}: run with "
        f"XLA_PYTHON_CLIENT_MEM_FRACTION={USABLE})",
    )
    ap.add_argument("--train-only", action="store_true", help="skip the eval step")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="price the train step's kernels on the target (a step-time table by category; tools/step_profile/)",
    )
    args = ap.parse_args(rest)
    try:
        target_config(args.target)
        if args.devices < 1:
            raise AotError(f"--devices: must be >= 1, got {args.devices}")
        if not 0 < args.usable <= 1:
            raise AotError(f"--usable: a share in (0, 1], got {args.usable}")
        require()
        cfg = load(args.config, overrides)
        if args.mesh:
            sizes = parse_mesh(args.mesh)
            if math.prod(sizes) != args.devices:
                raise AotError(
                    f"--mesh {args.mesh}: {math.prod(sizes)} devices, but --devices {args.devices}; "
                    "make the product equal --devices"
                )
            cfg.parallel.update(mesh_fields(sizes))
        steps = "train step" if args.train_only else "train and eval steps"
        with ticking(f"aot: compiling the {steps} for {args.devices} x {args.target}"):
            rep = compile_config(
                cfg,
                args.target,
                args.devices,
                programs=("train",) if args.train_only else ("train", "eval"),
                usable=args.usable,
                profile=args.profile,
            )
    except AotError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    rep["config"] = args.config
    print(to_text(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return rep


if __name__ == "__main__":
    main()
