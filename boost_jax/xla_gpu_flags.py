"""The XLA flags for GPU training, in one place: the trainer applies them, the SLURM template exports them,
and this module's command prints them.

    python -m boost_jax.xla_gpu_flags            # $XLA_FLAGS plus every flag below it does not set
    python -m boost_jax.xla_gpu_flags --explain  # the flags with what each is for

They overlap communication with compute (the latency-hiding scheduler, pipelined FSDP collectives,
combined collectives); CUDA graphs stay on. A flag already named in `XLA_FLAGS` is left as the user
set it; `MEASURE` lists flags worth an A/B run that are not applied. XLA aborts at start-up on a flag
it does not know, so `tests/test_launch.py` checks every name against the installed jaxlib. A step
built for GPU devices (runtime/build.py) carries them as compiler options (`compiler_options()`),
deviceless compiles included; `train.run` calls `apply()` before JAX starts its backends when
`xla_gpu_flags` is true and a CUDA plugin is installed. Nothing here imports jax, and the module sits
at the bottom of the layers (no project imports).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

FLAGS = (  # (flag, what it is for)
    ("--xla_gpu_enable_latency_hiding_scheduler=true", "schedule async collectives to overlap compute"),
    ("--xla_gpu_enable_highest_priority_async_stream=true", "collectives' stream runs first when ready"),
    ("--xla_gpu_enable_pipelined_all_gather=true", "FSDP: the next layer's gather during this layer (scan)"),
    ("--xla_gpu_enable_pipelined_reduce_scatter=true", "FSDP: the previous layer's grad reduce-scatter likewise"),
    ("--xla_gpu_enable_pipelined_all_reduce=true", "the same for data-parallel gradient all-reduces"),
    ("--xla_gpu_enable_while_loop_double_buffering=true", "unroll the layer scan x2: room to overlap"),
    ("--xla_gpu_all_reduce_combine_threshold_bytes=134217728", "merge small all-reduces up to 128 MiB"),
    ("--xla_gpu_all_gather_combine_threshold_bytes=134217728", "merge small all-gathers up to 128 MiB"),
    ("--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728", "merge small reduce-scatters up to 128 MiB"),
)
MEASURE = (  # worth an A/B run; not applied
    (
        "--xla_gpu_enable_command_buffer=",
        "empty: no CUDA graphs (XLA's default runs them; the A/B: benchmarks/RESULTS.md 2026-11-27 (sixth))",
    ),
    (
        "--xla_gpu_enable_triton_gemm=false",
        "cuBLAS for every GEMM: the low-rank GEMMs are skinny and either may win (the A/B runs: "
        "benchmarks/RESULTS.md 2026-11-28 (H200))",
    ),
)
# what `pip install jax[cuda13|cuda12]` installs (the plugins register under jax_plugins; older
# releases shipped top-level modules)
CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12", "jax_cuda13_plugin", "jax_cuda12_plugin")
NVIDIA_DRIVER = ("/proc/driver/nvidia/version", "/dev/nvidiactl")  # a driver is loaded (a GPU host)


def _name(flag: str) -> str:
    return flag.split("=", 1)[0]


def merged(xla_flags: str = "") -> tuple[str, list[str]]:
    """(xla_flags followed by every FLAGS entry it does not name, the entries added)."""
    have = {_name(f) for f in xla_flags.split()}
    added = [flag for flag, _ in FLAGS if _name(flag) not in have]
    return " ".join([xla_flags.strip(), *added]).strip(), added


def _option_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    return int(text) if text.isdigit() else text


def compiler_options(environ=os.environ) -> dict:
    """FLAGS as per-program XLA compiler options (`jax.jit(..., compiler_options=...)`), less the
    flags XLA_FLAGS names (the user's values win): how a step built for GPU devices carries them,
    also when it is compiled on a host whose backends started without them (runtime/build.py)."""
    _, added = merged(environ.get("XLA_FLAGS", ""))
    return {_name(flag).lstrip("-"): _option_value(flag.split("=", 1)[1]) for flag in added}


# XLA:GPU tiles a Triton GEMM fusion through the transposes and reshapes fused into it: a GEMM
# dimension that is a (outer, inner) pair of a transposed operand (attention's heads x head_dim into
# the output projection; a tensor-train core's modes) takes only tiles that divide `inner` or that it
# divides. The tile sizes a deviceless compile gives a fusion (no autotuning) are powers of two up to
# TRITON_TILE, and XLA does not check them against such a pair: the compile fails ("Couldn't find
# output tile sizes that satisfy hlo", jaxlib 0.10.2: cola_3b / llama_3b's head_dim 100, tt_1b's
# d_ff modes 19 x 18). A program whose model has such a width runs every GEMM on cuBLAS instead.
TRITON_GEMM = "xla_gpu_enable_triton_gemm"
TRITON_TILE = 64


def triton_tiles(width: int) -> bool:
    """Every power-of-two tile up to TRITON_TILE divides `width` or is a multiple of it."""
    return width % TRITON_TILE == 0 or TRITON_TILE % width == 0


def gemm_options(split_widths: dict, environ=os.environ) -> dict:
    """{TRITON_GEMM: False} when one of `split_widths` ({what: inner width of a dimension pair a GEMM
    operand may be tiled through}) is not `triton_tiles`, unless XLA_FLAGS names the flag (the user's
    value wins); else {}."""
    if TRITON_GEMM in {_name(f).lstrip("-") for f in environ.get("XLA_FLAGS", "").split()}:
        return {}
    return {} if all(triton_tiles(int(w)) for w in split_widths.values()) else {TRITON_GEMM: False}


_ACCEPTED: dict = {}  # (platform, device kind, option names) -> the names this jaxlib's XLA takes
DROPPED: set = set()  # options some program here was built without (reported once, by warning)


def accepted(options: dict, device) -> dict:
    """`options` less the ones this jaxlib's XLA has no DebugOptions field for. XLA keeps a retired
    flag parsing in XLA_FLAGS as a no-op, but a per-program option it no longer has fails the compile
    ("No such compile option: 'xla_gpu_enable_pipelined_all_reduce'", jax 0.11.2). Probed once per
    device kind and option set by compiling a one-op program for `device` (deviceless devices too;
    imports jax, unlike the rest of this module). A probe that fails for any other reason keeps them all:
    the real compile then says what is wrong."""
    if not options:
        return options
    key = (device.platform, device.device_kind, tuple(sorted(options)))
    if key not in _ACCEPTED:
        import re
        import warnings

        import jax
        import jax.numpy as jnp
        from jax.sharding import SingleDeviceSharding

        keep = dict(options)
        one = jax.ShapeDtypeStruct((1,), jnp.float32, sharding=SingleDeviceSharding(device))
        while keep:
            try:
                jax.jit(lambda a: a + 1, compiler_options=keep).lower(one).compile()
                break
            except Exception as e:  # noqa: BLE001 - only an unknown option is acted on
                m = re.search(r"No such compile option: '([^']+)'", str(e))
                if not m or m.group(1) not in keep:
                    break
                keep.pop(m.group(1))
        _ACCEPTED[key] = set(keep)
        gone = sorted(set(options) - set(keep) - DROPPED)
        if gone:
            DROPPED.update(gone)
            warnings.warn(
                f"this jaxlib's XLA has no compile option {', '.join(gone)}: GPU steps are built "
                f"without (boost_jax/xla_gpu_flags.py)",
                stacklevel=2,
            )
    return {k: v for k, v in options.items() if k in _ACCEPTED[key]}


# XLA's collective pipeliner: the FSDP gathers and gradient reductions of the layer scan moved one
# iteration ahead/behind. jaxlib 0.11's XLA has none of these options: a per-program option names one
# and the compile fails ("No such compile option: 'xla_gpu_enable_pipelined_all_reduce'", jax 0.11.2
# on an H100, benchmarks/RESULTS.md 2026-11-26), and in XLA_FLAGS they parse as no-ops. `accepted()`
# probes that with a compile for the target device; the planner cannot (it prices plans without
# devices), so it reads the installed jaxlib's version instead: `pipelined()`.
PIPELINED = (
    "xla_gpu_enable_pipelined_all_gather",
    "xla_gpu_enable_pipelined_reduce_scatter",
    "xla_gpu_enable_pipelined_all_reduce",
)
PIPELINED_RETIRED = (0, 11)  # the first jaxlib without them


def _jaxlib_version() -> tuple[int, ...] | None:
    import importlib.metadata

    try:
        text = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(x) for x in text.split(".")[:2] if x.isdigit())


_JAXLIB: list = []  # the installed jaxlib's (major, minor), read once


def pipelined(environ=os.environ, jaxlib=None) -> frozenset:
    """The collective pipeliner's options (PIPELINED names) a GPU step built in this process compiles
    with: FLAGS' value, or the user's where XLA_FLAGS names the option (as `compiler_options()` and
    `apply()` give them), none where the installed jaxlib's XLA has retired them (>= 0.11: see
    PIPELINED_RETIRED) and none without jaxlib. `jaxlib`: a (major, minor) to ask about instead. The
    one place the planner learns whether the program it prices gets them."""
    if jaxlib is None:
        if not _JAXLIB:
            _JAXLIB.append(_jaxlib_version())
        jaxlib = _JAXLIB[0]
    if jaxlib is None or tuple(jaxlib) >= PIPELINED_RETIRED:
        return frozenset()
    return frozenset(k for k, v in switches(environ).items() if k in PIPELINED and v)


# XLA's while-loop double buffering (FLAGS: the layer scan unrolled x2), which keeps one more stacked
# residual of the scan (planner/pricing/cost.py SCAN_DOUBLE_BUFFER)
DOUBLE_BUFFERING = "xla_gpu_enable_while_loop_double_buffering"


def double_buffered(environ=os.environ) -> bool:
    """Whether a GPU step built in this process compiles with XLA's while-loop double buffering:
    FLAGS' value, or the user's where XLA_FLAGS names it. The planner's one source for it."""
    return switches(environ).get(DOUBLE_BUFFERING, False)


def switches(environ=os.environ) -> dict:
    """{option: on} for every flag of XLA_FLAGS plus the FLAGS it does not name (what a GPU step built
    here compiles with), read as XLA reads a boolean flag: `--name`, `=true` or `=1` is on, anything
    else off, and a later repeat of a flag wins."""
    value, _ = merged(environ.get("XLA_FLAGS", ""))
    on = {}
    for flag in value.split():
        name, eq, v = flag.partition("=")
        on[name.lstrip("-")] = (not eq) or v.lower() in ("true", "1")
    return on


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is absent
        return False


def gpu_expected(environ=os.environ) -> bool:
    """A CUDA plugin of jax is installed, an NVIDIA driver is loaded (not only the plugin, as the
    `aot` extra installs it on CPU hosts) and JAX_PLATFORMS (if set) allows GPUs. Never starts a backend."""
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    return any(_found(name) for name in CUDA_PLUGINS) and any(os.path.exists(p) for p in NVIDIA_DRIVER)


class _NoGpuPluginNoise(logging.Filter):
    """Drops JAX's "Jax plugin configuration error" records about its CUDA plugin (a traceback that ends
    in "Unable to load cuFFT"), logged when the plugin cannot start: on a host without an NVIDIA driver
    it has nothing to say (JAX runs on the CPU, as it would without the plugin)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not (text.startswith("Jax plugin configuration error") and "cuda" in record.getMessage().lower())


QUIET_PLUGIN = _NoGpuPluginNoise()


def plugin_without_gpu() -> bool:
    """A CUDA plugin of jax is installed, but no NVIDIA driver is loaded."""
    return any(_found(name) for name in CUDA_PLUGINS) and not any(os.path.exists(p) for p in NVIDIA_DRIVER)


def quiet_gpu_plugin() -> bool:
    """The entry points call this before JAX starts its backends: where a CUDA plugin of jax is
    installed (the `aot` extra installs one) but no NVIDIA driver is loaded, its failed start is not
    reported. Where a driver is loaded, a plugin that fails is a real problem and is reported as JAX
    reports it. Returns whether the filter is on."""
    if not plugin_without_gpu():
        return False
    logging.getLogger("jax._src.xla_bridge").addFilter(QUIET_PLUGIN)  # (added once: a Filter is kept once)
    return True


def _backends_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge  # private: guarded, and only asked once jax is imported

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return False


def apply(environ=os.environ) -> tuple[list[str], str]:
    """Add the missing FLAGS to XLA_FLAGS when a GPU run is expected: (flags added, why none were)."""
    if not gpu_expected(environ):
        return [], "no CUDA jax plugin or NVIDIA driver, or JAX_PLATFORMS excludes GPUs"
    value, added = merged(environ.get("XLA_FLAGS", ""))
    if not added:
        return [], "XLA_FLAGS already names every flag"
    if _backends_started():
        return [], (
            "jax started its backends before the flags could be set (export them first: "
            '`export XLA_FLAGS="$(python -m boost_jax.xla_gpu_flags)"`)'
        )
    environ["XLA_FLAGS"] = value
    return added, ""


def main(argv=None) -> int:
    """`python -m boost_jax.xla_gpu_flags [--explain]`: XLA_FLAGS with FLAGS merged in (the user's values
    win), or each flag with what it is for and the MEASURE flags worth an A/B run."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--explain"]:
        for flag, why in FLAGS:
            print(f"{flag:60s} {why}")
        for flag, why in MEASURE:
            print(f"{flag:60s} (not applied) {why}")
        return 0
    if argv:
        print("usage: python -m boost_jax.xla_gpu_flags [--explain]", file=sys.stderr)
        return 2
    print(merged(os.environ.get("XLA_FLAGS", ""))[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
