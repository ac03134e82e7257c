"""GPU benchmark and kernel check in one command; prints the whole table and writes JSON.

    python benchmarks/gpu_bench.py [--steps 10] [--json benchmarks/gpu_bench.json] [--parts a,b,...]
    python benchmarks/gpu_bench.py --smoke      # tiny shapes on any backend: checks the command runs
    python benchmarks/gpu_bench.py --aot h100   # no GPU needed: compiles every part for H100s, deviceless

Parts (each isolated: a part or variant that fails prints its error in its row, the rest still run):

- device: `device_kind`, platform, jax / jaxlib / triton / jax-triton versions, date.
- rmsnorm: the fused RMSNorm(+Σx²) of `kernels.rmsnorm` = xla / pallas / triton on [16384, 4096]
  bf16: forward and forward+backward in GB/s and as a fraction of the measured copy bandwidth
  (target >= 80%). Bytes are the minimum traffic: forward reads x and writes y (2 x.nbytes); the
  backward reads x and dy and writes dx (3 more). `ran` is what `kernels_used()` says ran, so a
  kernel that fell back to XLA is reported as such, never timed under its own name.
- attention: `model.attention` = xla / chunked / pallas / cudnn, forward+backward at a 7B head
  shape (batch 1, seq 4096, 32 heads x 128, causal, bf16): ms, TFLOP/s (causal FLOPs: forward
  2·B·H·T²·Dh, backward 2.5x forward), speed vs xla.
- layer7b: a one-layer model of llama_7b vs cola_7b widths (d 4096, I 11008, r 1024, vocabulary
  32000: embedding and head included), seq 4096, batch 2: train step ms, tokens/s, MFU, cola/llama.
- train1b: llama_1b vs cola_1b at seq 4096, batch 4 (targets on one H100: cola_1b step <= 0.70x
  llama_1b; llama_1b MFU >= 45%), and cola_1b with each BOOST option toggled (grouping, the norm
  kernels, remat policies). Every train variant runs in a fresh process, so peak memory is its own.
- train256: cola_1b and llama_1b at seq 256 x batch 32 (CoLA's per-GPU micro-batch) and 4096 x 4: the
  `auto` defaults (boost_jax/model/autos.py) beside the defaults before them, bf16 parameters, and each
  auto choice turned back one at a time.
- tests: `tests/test_gpu_kernels.py` with JAX_PLATFORMS=cuda (the compiled kernels against the jnp
  references, failing on any fallback); `--smoke` runs it on the current platform (it skips there).

Model dtype is `auto` (bf16 on GPU) and attention `auto` (cuDNN on GPU), the trainer's defaults.

`--one-process` runs the train variants in one process (XLA's autotuning is shared: faster when GPU
time is short; each row's compiled peak is still its own). `--profile DIR` traces each train variant's
steps after timing them (jax.profiler, benchmarks/step_profile_trace.py): DIR/NAME.events.json holds
the device time per kernel and HLO instruction, DIR/NAME.hlo.gz the compiled program, and the row its
measured time by category (boost_jax/tools/step_profile/), beside the deviceless prediction.

`--aot TARGET` (needs the aot extra, `boost_jax/tools/aot.py`) times nothing: it compiles every program
the selected parts would time for TARGET GPUs on this host, without one (XLA's deviceless compile), at
the same shapes (`--smoke`: the tiny ones), and prints one line per program: compiled OK with the
kernels it holds (cuDNN attention, Triton/Pallas kernels), a train variant's peak memory against the
GPU's, or the one-line reason it failed (a kernel that fell back to XLA or a step that does not fit
counts as failed). So time on a GPU goes to timing, never to debugging.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PARTS = ("device", "rmsnorm", "attention", "layer7b", "train1b", "train256", "tests")
TRAIN_PARTS = ("layer7b", "train1b", "train256")
NORM_IMPLS = ("xla", "pallas", "triton")
TARGETS = {"rmsnorm": 0.80, "cola_over_llama_1b": 0.70, "llama_1b_mfu": 0.45}


def shapes(smoke: bool) -> dict:
    """Every shape the parts use; --smoke shrinks them to run anywhere in seconds."""
    if smoke:
        return {
            "norm": (64, 256),
            "attention": (1, 64, 4, 16),
            "seq": 32,
            "batch1b": 2,
            "batch7b": 2,
            "size": dict(d_model=64, d_ff=128, n_heads=4, n_kv_heads=4, rank=16, vocab_size=256, n_layers=2),
        }
    return {
        "norm": (16384, 4096),
        "attention": (1, 4096, 32, 128),
        "seq": 4096,
        "batch1b": 4,
        "batch7b": 2,
        "size": None,
    }


def train_variants(smoke: bool) -> list[dict]:
    """(part, name, config, overrides): config names configs/NAME.py."""
    one_layer = {"model.n_layers": 1}
    rows = [
        ("layer7b", "llama_7b, 1 layer", "llama_7b", one_layer),
        ("layer7b", "cola_7b, 1 layer", "cola_7b", one_layer),
        ("train1b", "llama_1b", "llama_1b", {}),
        ("train1b", "cola_1b", "cola_1b", {}),
        ("train1b", "cola_1b ungrouped", "cola_1b", {"model.group_linears": False}),
        ("train1b", "cola_1b pallas norm", "cola_1b", {"kernels.rmsnorm": "pallas"}),
        ("train1b", "cola_1b triton norm", "cola_1b", {"kernels.rmsnorm": "triton"}),
        ("train1b", "cola_1b remat lowrank", "cola_1b", {"remat.policy": "lowrank"}),
        ("train1b", "cola_1b remat full", "cola_1b", {"remat.policy": "full"}),
        ("train1b", "llama_1b remat full", "llama_1b", {"remat.policy": "full"}),
    ]
    # seq 256 x batch 32 (CoLA's per-GPU micro-batch for 1B; ../shared/reference/gpu-h100.md) and seq 4096 x 4:
    # the defaults (`auto`, model/autos.py) against the defaults before them ("before": grouped, scanned,
    # remat none, XLA's norm, CUDA graphs off) and one change at a time. "xla:--NAME" entries set a flag of
    # boost_jax/xla_gpu_flags.py FLAGS for that variant only (None: left out).
    before = {
        "model.group_linears": True,
        "model.scan_unroll": False,
        "remat.policy": "none",
        "kernels.rmsnorm": "xla",
        "xla:--xla_gpu_enable_command_buffer": "",
    }
    at256 = {"train.seq_len": 256, "train.global_batch": 32}
    at4096 = {"train.seq_len": 4096, "train.global_batch": 4}
    bf16 = {"model.param_dtype": "bfloat16"}
    cublas = {"xla:--xla_gpu_enable_triton_gemm": "false"}  # every GEMM through cuBLAS (XLA's Triton GEMMs off)
    rows += [
        (p, n, c, {**at256, **o})
        for p, n, c, o in (
            # in the order a short lease should measure them: the targets' four rows, then one change each
            ("train256", "cola_1b auto", "cola_1b", {}),
            ("train256", "llama_1b auto", "llama_1b", {}),
            ("train256", "cola_1b auto seq 4096", "cola_1b", at4096),
            ("train256", "llama_1b auto seq 4096", "llama_1b", at4096),
            # the residual add + norm inside the first-stage GEMMs (kernels/norm_gemm.py) off: the norm apart
            ("train256", "cola_1b auto norm apart", "cola_1b", {"model.bottleneck_kernel": "rope"}),
            ("train256", "cola_1b auto seq 4096 norm apart", "cola_1b", {**at4096, "model.bottleneck_kernel": "rope"}),
            # the changes before, each against its `auto` row above: the gate product, CoLA's σ
            # and q/k's RoPE inside the GEMMs (kernels/gated_gemm.py) all off, then one at a time
            ("train256", "cola_1b auto pallas gate product", "cola_1b", {"model.gate_kernel": "pallas"}),
            ("train256", "cola_1b auto xla sigma", "cola_1b", {"model.bottleneck_kernel": "xla"}),
            ("train256", "cola_1b auto xla rope", "cola_1b", {"model.bottleneck_kernel": "gemm"}),
            (
                "train256",
                "cola_1b auto seq 4096 pallas gate product",
                "cola_1b",
                {**at4096, "model.gate_kernel": "pallas"},
            ),
            ("train256", "cola_1b auto xla gate product", "cola_1b", {"model.gate_kernel": "xla"}),
            ("train256", "llama_1b auto pallas gate product", "llama_1b", {"model.gate_kernel": "pallas"}),
            ("train256", "cola_1b auto separate residual adds", "cola_1b", {"kernels.residual_norm": "separate"}),
            ("train256", "llama_1b auto separate residual adds", "llama_1b", {"kernels.residual_norm": "separate"}),
            ("train256", "cola_1b auto ungrouped", "cola_1b", {"model.group_linears": False}),
            ("train256", "cola_1b auto float32 logits", "cola_1b", {"model.logits_dtype": "float32"}),
            ("train256", "llama_1b auto float32 logits", "llama_1b", {"model.logits_dtype": "float32"}),
            ("train256", "cola_1b auto xla norm", "cola_1b", {"kernels.rmsnorm": "xla"}),
            ("train256", "llama_1b auto xla norm", "llama_1b", {"kernels.rmsnorm": "xla"}),
            ("train256", "cola_1b auto cuBLAS GEMMs", "cola_1b", cublas),
            ("train256", "llama_1b auto cuBLAS GEMMs", "llama_1b", cublas),
            ("train256", "cola_1b auto attention xla", "cola_1b", {"model.attention": "xla"}),
            ("train256", "cola_1b auto attention pallas", "cola_1b", {"model.attention": "pallas"}),
            ("train256", "cola_1b auto seq 4096 xla norm", "cola_1b", {**at4096, "kernels.rmsnorm": "xla"}),
            ("train256", "cola_1b auto bf16 params", "cola_1b", bf16),
            ("train256", "llama_1b auto bf16 params", "llama_1b", bf16),
            ("train256", "cola_1b before", "cola_1b", before),
            ("train256", "llama_1b before", "llama_1b", before),
            ("train256", "cola_1b auto grouped", "cola_1b", {"model.group_linears": True}),
            ("train256", "llama_1b auto ungrouped", "llama_1b", {"model.group_linears": False}),
            ("train256", "cola_1b auto scanned", "cola_1b", {"model.scan_unroll": False}),
            ("train256", "cola_1b auto no cuda graphs", "cola_1b", {"xla:--xla_gpu_enable_command_buffer": ""}),
        )
    ]
    if smoke:  # one of each kind of row: a 1B baseline, a kernel toggle, a 7B layer
        rows = [
            r
            for r in rows
            if r[1] in ("llama_1b", "cola_1b triton norm", "cola_7b, 1 layer", "cola_1b before", "cola_1b auto")
        ]
    return [dict(part=p, name=n, config=c, overrides=o) for p, n, c, o in rows]


# ------------------------------------------------------------------------------------------ timing


def timed(fn, *args, steps: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile + warm up
    t0 = time.perf_counter()
    for _ in range(steps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"


# ------------------------------------------------------------------------------------------- parts


def device_info() -> dict:
    import importlib.metadata as md

    import jax

    versions = {}
    for pkg in ("jax", "jaxlib", "triton", "jax-triton"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    dev = jax.devices()[0]
    return {
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "device_count": jax.device_count(),
        "date": time.strftime("%Y-%m-%d"),
        "versions": versions,
    }


def norm_programs(impl: str) -> tuple:
    """The timed programs of one `kernels.rmsnorm` implementation: (pass, jitted fn, bytes moved in
    units of x.nbytes); `fwd` takes (x, w), `fwd+bwd` (x, w, dy)."""
    import jax
    import jax.numpy as jnp

    from boost_jax.kernels.rmsnorm import rmsnorm

    fwd = jax.jit(lambda x, w: rmsnorm(x, w, 1e-6, impl=impl))

    def loss(x, w, dy):
        y, s = rmsnorm(x, w, 1e-6, impl=impl)
        return jnp.sum((y * dy).astype(jnp.float32)) + jnp.sum(s)

    # The loss's value too: jax.grad alone lets XLA drop the forward kernel (the backward does not
    # read y), and the pass would time the backward's 3 x.nbytes under fwd+bwd's 5.
    return (("fwd", fwd, 2), ("fwd+bwd", jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), 5))


def copy_program():
    """The bandwidth reference the norms are measured against: x + 1 (reads x, writes y)."""
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda a: a + jnp.asarray(1, a.dtype))


def rmsnorm_rows(steps: int, smoke: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from boost_jax.kernels.rmsnorm import kernels_used

    rows, d = shapes(smoke)["norm"]
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    x = jax.random.normal(jax.random.key(0), (rows, d), dtype)
    w = jnp.ones((d,), jnp.float32)
    gy = jax.random.normal(jax.random.key(1), (rows, d), dtype)
    copy_s = timed(copy_program(), x, steps=steps)
    copy_gbs = 2 * x.nbytes / copy_s / 1e9
    out = [
        {"impl": "copy (x + 1)", "pass": "-", "ms": 1e3 * copy_s, "gb_per_s": copy_gbs, "fraction": 1.0, "ran": "xla"}
    ]
    for impl in NORM_IMPLS:
        for name, fn, moved in norm_programs(impl):
            try:
                kernels_used()
                secs = timed(fn, *((x, w) if name == "fwd" else (x, w, gy)), steps=steps)
                ran = kernels_used()["rmsnorm"]
                gbs = moved * x.nbytes / secs / 1e9
                out.append(
                    {
                        "impl": impl,
                        "pass": name,
                        "ms": 1e3 * secs,
                        "gb_per_s": gbs,
                        "fraction": gbs / copy_gbs,
                        "ran": ran,
                    }
                )
            except Exception as e:  # noqa: BLE001 - the row says what failed; the others run
                out.append({"impl": impl, "pass": name, "error": _error(e)})
    return out


def attention_program(impl: str):
    """fwd+bwd of `model.attention` = impl, jitted: (q, k, v) [B, T, H, Dh] -> their gradients."""
    import jax
    import jax.numpy as jnp

    from boost_jax.model.attention import attend

    loss = lambda q, k, v: jnp.sum(attend(q, k, v, impl=impl).astype(jnp.float32))  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def attention_rows(steps: int, smoke: bool, shape=None, impls=None) -> list[dict]:
    """fwd+bwd of each registered `model.attention` implementation (or `impls`) on q = k = v: [B, T, H, Dh]."""
    import jax
    import jax.numpy as jnp

    from boost_jax.model.attention import IMPLEMENTATIONS

    impls = tuple(IMPLEMENTATIONS) if impls is None else impls

    b, t, h, dh = shape or shapes(smoke)["attention"]
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (b, t, h, dh), dtype) for kk in ks)
    flops = 3.5 * 2 * b * h * t * t * dh  # causal: half of 4·B·H·T²·Dh forward; backward 2.5x
    out = []
    for impl in impls:
        try:
            secs = timed(attention_program(impl), q, k, v, steps=steps)
            out.append({"impl": impl, "ms": 1e3 * secs, "tflops": flops / secs / 1e12})
        except Exception as e:  # noqa: BLE001
            out.append({"impl": impl, "error": _error(e)})
    base = next((r for r in out if r["impl"] == "xla" and "ms" in r), None)
    for r in out:
        if "ms" in r and base:
            r["speedup_vs_xla"] = base["ms"] / r["ms"]
    return out


def variant_config(spec: dict, smoke: bool):
    """(config, batch, seq) of one train variant: one device, random tokens, the variant's overrides."""
    from boost_jax.config import load_config_file
    from boost_jax.validate import validate

    sh = shapes(smoke)
    cfg = load_config_file(os.path.join(ROOT, "configs", f"{spec['config']}.py"))
    if sh["size"]:
        cfg.model.update(sh["size"])
    batch = sh["batch7b"] if spec["part"] == "layer7b" else sh["batch1b"]
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, sh["seq"])
    cfg.train.update(seq_len=sh["seq"], global_batch=batch, grad_accum=1)
    cfg.parallel.update(data=1, fsdp=1, tensor=1, num_devices=1)
    cfg.data.source = "embedded"  # nothing is read: the step is fed random tokens
    cfg.data.batching = "stream"  # model costs as before documents (benchmarks/batching.py measures those)
    for key, value in spec["overrides"].items():
        if key.startswith("xla:") or (smoke and key.startswith("train.")):  # flags: xla_flags(); smoke: tiny
            continue
        section, name = key.split(".")
        cfg[section][name] = value
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, cfg.train.seq_len)
    validate(cfg)
    return cfg, cfg.train.global_batch, cfg.train.seq_len


def xla_flags(spec: dict) -> tuple:
    """boost_jax/xla_gpu_flags.py FLAGS as the variant sets them: `xla:--NAME` overrides give the
    flag's value (None: the flag is left out, so XLA's own default holds)."""
    from boost_jax import xla_gpu_flags

    changed = {k[4:]: v for k, v in spec["overrides"].items() if k.startswith("xla:")}
    flags = [(f, why) for f, why in xla_gpu_flags.FLAGS if f.split("=", 1)[0] not in changed]
    return tuple(flags + [(f"{name}={value}", "this variant") for name, value in changed.items() if value is not None])


def train_variant(spec: dict, steps: int, smoke: bool, profile_dir: str | None = None) -> dict:
    """One variant, in this process: compile, warm up, time `steps` steps; with `profile_dir`, then
    trace PROFILE_STEPS more (`profile`)."""
    import jax

    from boost_jax import xla_gpu_flags
    from boost_jax.model import flops_per_token
    from boost_jax.runtime.metrics import peak_flops
    from boost_jax.tools.aot import peak_bytes

    sys.path.insert(0, HERE)
    from step_time import build, timed_steps  # the benchmarks' one way to build and time a real train step

    cfg, batch, seq = variant_config(spec, smoke)
    flags = xla_gpu_flags.FLAGS
    xla_gpu_flags.FLAGS = xla_flags(spec)  # read by build() as the step's compiler options
    try:
        step, state, tokens = build(cfg, jax.devices()[:1])
        t0 = time.perf_counter()
        step = step.lower(state, tokens).compile()  # one compile: it runs, and its memory is read
        compile_s = time.perf_counter() - t0
    finally:
        xla_gpu_flags.FLAGS = flags
    mem = step.memory_analysis()
    compiled_peak = peak_bytes(mem) if mem is not None else None
    state, metrics, secs = timed_steps(step, state, tokens, 2, steps)
    tok_s = batch * seq / secs
    fpt = flops_per_token(cfg.model, seq)
    peak = peak_flops(jax.devices()[0].device_kind)
    stats = jax.devices()[0].memory_stats() or {}
    from boost_jax.kernels.rmsnorm import kernels_used

    extra = {}
    if profile_dir:
        extra["profile"] = profile(step, state, tokens, profile_dir, spec["name"], secs)
    return {
        **extra,
        "step_ms": 1e3 * secs,
        "tokens_per_s": tok_s,
        "tflops": fpt * tok_s / 1e12,
        "mfu": fpt * tok_s / peak if peak else None,
        "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
        "compiled_peak_gib": compiled_peak / 2**30 if compiled_peak is not None else None,
        "compile_s": compile_s,
        "norm_ran": kernels_used()["rmsnorm"],
        "seq": seq,
        "batch": batch,
        "compiler_options_dropped": sorted(xla_gpu_flags.DROPPED),
    }


PROFILE_STEPS = 2


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def profile(step, state, tokens, out_dir: str, name: str, step_s: float) -> dict:
    """Trace PROFILE_STEPS steps of a compiled, warm step with jax.profiler (step_profile_trace.py's
    `trace_compiled`, the one place the project traces a step): under out_dir, NAME.events.json (the
    device time per kernel and HLO instruction) and NAME.hlo.gz (the compiled program they name), read
    by `python -m boost_jax.tools.step_profile --hlo NAME.hlo.gz --events NAME.events.json` beside the
    deviceless prediction. Returns the measured time by category (tools/step_profile/traces.py `measured`)."""
    from pathlib import Path

    from step_profile_trace import trace_compiled

    from boost_jax.tools.step_profile import traces as step_traces

    found = trace_compiled(step, state, tokens, Path(out_dir), _slug(name), PROFILE_STEPS, step_s)
    got = step_traces.measured(found["events"], step.as_text())
    return {"kernels": sum(e["count"] for e in found["events"]["events"]), **got}


def run_variants(
    specs: list[dict],
    steps: int,
    smoke: bool,
    one_process: bool = False,
    profile_dir=None,
    on_row=None,
    profile_only: str | None = None,
) -> list[dict]:
    """Each variant in a fresh process (its own peak memory); --smoke and `one_process` run them all in
    one (compiles share XLA's in-process autotuning cache: faster when GPU time is short; each row's
    compiled peak is still its own, the measured peak is the process's so far). Rows are reported to
    `on_row` as they finish, so a run cut short keeps them. The processes may allocate the share of the
    GPU's memory `--aot` checks a step against (aot.USABLE, unless XLA_PYTHON_CLIENT_MEM_FRACTION is
    set): JAX's default 75% would not hold llama_1b's step."""
    from boost_jax.tools.aot import USABLE

    groups = [specs] if smoke or one_process else [[s] for s in specs]
    rows = []
    for group in groups:
        cmd = [sys.executable, os.path.abspath(__file__), "--variants", json.dumps(group), "--steps", str(steps)]
        cmd += ["--smoke"] if smoke else []
        cmd += ["--profile", profile_dir] if profile_dir else []
        cmd += ["--profile-only", profile_only] if profile_only else []
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
            "XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", str(USABLE)),
        }
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        done = set()
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            res = json.loads(line)
            spec = next(s for s in group if s["name"] == res["name"])
            row = {"part": spec["part"], "variant": spec["name"], **{k: v for k, v in res.items() if k != "name"}}
            rows.append(row)
            done.add(spec["name"])
            if on_row:
                on_row(row)
        err = proc.stderr.read()
        proc.wait()
        why = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1][:200]
        for spec in group:
            if spec["name"] not in done:
                row = {"part": spec["part"], "variant": spec["name"], "error": why or "no result (see stderr)"}
                rows.append(row)
                if on_row:
                    on_row(row)
    return rows


def kernel_tests(smoke: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    if not smoke:
        env["JAX_PLATFORMS"] = "cuda"
    # one process (-n 0): xdist's workers would each take JAX's share of the one GPU's memory
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-n",
        "0",
        "--tb=short",
        "-p",
        "no:cacheprovider",
        os.path.join(ROOT, "tests", "test_gpu_kernels.py"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    summary = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    failures = [ln for ln in r.stdout.splitlines() if ln.startswith("FAILED")]
    return {
        "command": "JAX_PLATFORMS=cuda pytest tests/test_gpu_kernels.py"
        if not smoke
        else "pytest tests/test_gpu_kernels.py",
        "returncode": r.returncode,
        "summary": summary,
        "failed": failures[:20],
        "output_tail": r.stdout[-6000:] if r.returncode else "",
    }


# ------------------------------------------------------------------------- compiling for a GPU: --aot


def _compiled_row(part: str, name: str, compile_fn) -> dict:
    """compile_fn() -> (compiled, extra fields); the row says compiled OK with what the program holds,
    or the one-line reason it did not compile."""
    from boost_jax.tools import aot

    t0 = time.perf_counter()
    try:
        compiled, extra = compile_fn()
    except Exception as e:  # noqa: BLE001 - the row says what failed; the others compile
        return {"part": part, "name": name, "ok": False, "error": _error(e)}
    row = {
        "part": part,
        "name": name,
        "ok": True,
        "compile_s": time.perf_counter() - t0,
        "kernels": aot.kernels(compiled.as_text()),
        **extra,
    }
    if row.get("fits") is False:
        row["ok"] = False
        row["error"] = (
            f"does not fit: peak {row['peak_bytes'] / 2**30:.1f} GiB of {row['usable_bytes'] / 2**30:.1f} GiB usable"
        )
    if "ran" in row and row["ran"] != row["impl"]:  # a kernel that fell back would be timed as XLA
        row["ok"] = False
        row["error"] = f"kernels.rmsnorm={row['impl']} fell back: {row['ran']}"
    return row


def aot_rows(target: str, parts: list[str], smoke: bool) -> list[dict]:
    """Every program the selected parts would time, compiled for `target` GPUs without one: the
    kernels and attention on one deviceless device (traced under kernels/platform.py's target, so
    they take their GPU paths: cuDNN, Pallas/Triton kernels, bf16), each train variant through
    runtime/build.py on one deviceless device, with its peak memory against the GPU's."""
    import jax.numpy as jnp

    from boost_jax.kernels import platform
    from boost_jax.kernels.rmsnorm import kernels_used
    from boost_jax.model.attention import IMPLEMENTATIONS
    from boost_jax.runtime.build import build
    from boost_jax.tools import aot

    dev = aot.devices(target, 1)[0]
    sh = shapes(smoke)
    rows = []

    def lowered(fn, *specs):  # fn traced for the GPU, from shapes placed on it
        with platform.target(dev):
            args = [platform.abstract(shape, dtype) for shape, dtype in specs]
            return fn.lower(*args).compile()

    for part in parts:
        if part == "device":
            rows.append(
                {
                    "part": part,
                    "name": f"{dev.device_kind} (deviceless {target})",
                    "ok": True,
                    "device_kind": dev.device_kind,
                }
            )
        elif part == "rmsnorm":
            x, w = (sh["norm"], jnp.bfloat16), ((sh["norm"][1],), jnp.float32)
            rows.append(_compiled_row(part, "copy (x + 1)", lambda: (lowered(copy_program(), x), {})))
            for impl in NORM_IMPLS:
                for name, fn, _ in norm_programs(impl):

                    def norm(fn=fn, name=name, impl=impl):
                        kernels_used()
                        compiled = lowered(fn, *((x, w) if name == "fwd" else (x, w, x)))
                        return compiled, {"impl": impl, "ran": kernels_used()["rmsnorm"]}

                    rows.append(_compiled_row(part, f"{impl} {name}", norm))
        elif part == "attention":
            qkv = (sh["attention"], jnp.bfloat16)
            for impl in IMPLEMENTATIONS:
                rows.append(
                    _compiled_row(part, impl, lambda impl=impl: (lowered(attention_program(impl), qkv, qkv, qkv), {}))
                )
        elif part == "tests":
            rows.append(
                {
                    "part": part,
                    "name": "tests/test_gpu_kernels.py",
                    "ok": True,
                    "note": "nothing to compile here: the tests run the kernels on the GPU",
                }
            )
    memory = aot.target_memory(target)
    for spec in train_variants(smoke):
        if spec["part"] not in parts:
            continue

        def step(spec=spec):
            cfg, batch, seq = variant_config(spec, smoke)
            kernels_used()
            built = build(cfg, aot.devices(target, 1))
            compiled = built.lower_train().compile()
            found = aot.analyze(compiled, built.mesh, memory)
            return compiled, {k: found[k] for k in ("peak_bytes", "usable_bytes", "fits")} | {
                "norm_ran": kernels_used()["rmsnorm"],
                "seq": seq,
                "batch": batch,
            }

        rows.append(_compiled_row(spec["part"], spec["name"], step))
    return rows


def aot_line(r: dict) -> str:
    head = f"{r['part']} {r['name']}: "
    if not r["ok"]:
        return head + f"FAILED: {r['error']}"
    if "compile_s" not in r:
        return head + r.get("note", "ok")
    detail = [f"compiled OK in {r['compile_s']:.1f} s"]
    if "peak_bytes" in r:
        detail.append(f"peak {r['peak_bytes'] / 2**30:.2f} GiB of {r['usable_bytes'] / 2**30:.1f} usable")
    if "ran" in r:
        detail.append(f"ran {r['ran']}")
    if "norm_ran" in r:
        detail.append(f"norm {r['norm_ran']}")
    kernels = ", ".join(f"{k} x{v}" for k, v in r["kernels"].items() if not k.endswith("gemm"))
    detail.append(f"kernels: {kernels or 'none beyond XLA fusions and GEMMs'}")
    return head + "; ".join(detail)


def aot_main(target: str, parts: list[str], smoke: bool, path: str | None) -> int:
    from boost_jax.tools import aot

    if not aot.available():
        print(f"gpu_bench --aot needs the aot extra ({aot.missing()} missing): {aot.INSTALL}", file=sys.stderr)
        return 2
    if target not in aot.targets():
        print(f"gpu_bench --aot: unknown GPU {target!r}; one of {', '.join(aot.targets())}", file=sys.stderr)
        return 2
    rows = aot_rows(target, parts, smoke)
    for r in rows:
        print(aot_line(r), flush=True)
    failed = [r for r in rows if not r["ok"]]
    print(
        f"\n{len(rows) - len(failed)} of {len(rows)} compiled for {target}"
        + (f"; {len(failed)} FAILED" if failed else "")
        + (" [--smoke: tiny shapes]" if smoke else "")
    )
    path = path or os.path.join(tempfile.gettempdir(), f"gpu_bench_aot_{target}.json")
    with open(path, "w") as f:
        json.dump(
            {"aot": target, "smoke": smoke, "parts": parts, "shapes": shapes(smoke), "rows": rows},
            f,
            indent=2,
            default=str,
        )
    print(f"wrote {path}")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------- printing


def _gib(x):
    return "n/a" if x is None else f"{x:.1f}"


def _pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"


def print_tables(res: dict) -> None:
    dev = res.get("device")
    if dev and "error" in dev:
        print(f"device: error: {dev['error']}\n")
    elif dev:
        v = dev["versions"]
        print(
            f"device: {dev['device_kind']} ({dev['platform']} x{dev['device_count']}), jax {v['jax']}, jaxlib "
            f"{v['jaxlib']}, triton {v['triton']}, jax-triton {v['jax-triton']}, {dev['date']}"
            + ("  [--smoke: tiny shapes, not a measurement]" if res["smoke"] else "")
            + "\n"
        )
    if "rmsnorm" in res:
        rows = res["rmsnorm"]
        print(
            f"rmsnorm {res['shapes']['norm']} | pass | ms | GB/s | of copy (target >= "
            f"{100 * TARGETS['rmsnorm']:.0f}%) | ran\n|---|---|---|---|---|---|"
        )
        for r in rows:
            if "error" in r:
                print(f"| {r['impl']} | {r.get('pass', '')} | failed: {r['error']} ||||")
            else:
                print(
                    f"| {r['impl']} | {r['pass']} | {r['ms']:.3f} | {r['gb_per_s']:.0f} | "
                    f"{100 * r['fraction']:.0f}% | {r['ran']} |"
                )
        print()
    if "attention" in res:
        print(
            f"attention fwd+bwd {res['shapes']['attention']} (B, T, H, Dh) | ms | TFLOP/s | vs xla\n|---|---|---|---|"
        )
        for r in res["attention"]:
            if "error" in r:
                print(f"| {r['impl']} | failed: {r['error']} |||")
            else:
                speed = f"{r['speedup_vs_xla']:.2f}x" if "speedup_vs_xla" in r else "n/a"
                print(f"| {r['impl']} | {r['ms']:.2f} | {r['tflops']:.1f} | {speed} |")
        print()
    for part, title in (
        ("layer7b", "7B-shaped single layer"),
        ("train1b", "1B models"),
        ("train256", "1B models at seq 256 x batch 32, one change at a time"),
    ):
        rows = [r for r in res.get("train", []) if r["part"] == part]
        if not rows:
            continue
        base = next(
            (r for r in rows if r["variant"].startswith("llama") and "step_ms" in r and "remat" not in r["variant"]),
            None,
        )
        print(
            f"{title}: train step | seq x batch | step ms | tokens/s | TFLOP/s | MFU | peak GiB | compiled peak GiB | vs llama | norm ran"  # noqa: E501
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                print(f"| {r['variant']} | failed: {r['error']} |||||||||")
                continue
            ratio = f"{r['step_ms'] / base['step_ms']:.2f}x" if base else "n/a"
            print(
                f"| {r['variant']} | {r['seq']} x {r['batch']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | "
                f"{r['tflops']:.1f} | {_pct(r['mfu'])} | {r['peak_gib']:.1f} | {_gib(r.get('compiled_peak_gib'))} | {ratio} | {r['norm_ran']} |"  # noqa: E501
            )
        print()
    if "targets" in res:
        print("targets | value | target | met\n|---|---|---|---|")
        for t in res["targets"]:
            print(f"| {t['name']} | {t['value']} | {t['target']} | {t['met']} |")
        print()
    if "tests" in res:
        t = res["tests"]
        print(f"kernel tests ({t.get('command', '')}): " + (f"error: {t['error']}" if "error" in t else t["summary"]))
        for line in t.get("failed", []):
            print(f"  {line}")


def targets(res: dict) -> list[dict]:
    out = []
    norms = [
        r for r in res.get("rmsnorm", []) if r.get("pass") == "fwd+bwd" and "fraction" in r and r["ran"] == r["impl"]
    ]
    for r in norms:
        if r["impl"] != "xla":
            out.append(
                {
                    "name": f"rmsnorm {r['impl']} fwd+bwd of copy bandwidth",
                    "value": _pct(r["fraction"]),
                    "target": f">= {100 * TARGETS['rmsnorm']:.0f}%",
                    "met": r["fraction"] >= TARGETS["rmsnorm"],
                }
            )
    train = {r["variant"]: r for r in res.get("train", []) if "step_ms" in r}
    if "llama_1b" in train and "cola_1b" in train:
        ratio = train["cola_1b"]["step_ms"] / train["llama_1b"]["step_ms"]
        out.append(
            {
                "name": "cola_1b step / llama_1b step",
                "value": f"{ratio:.2f}x",
                "target": f"<= {TARGETS['cola_over_llama_1b']:.2f}x",
                "met": ratio <= TARGETS["cola_over_llama_1b"],
            }
        )
    if "llama_1b" in train:
        mfu = train["llama_1b"]["mfu"]
        out.append(
            {
                "name": "llama_1b MFU",
                "value": _pct(mfu),
                "target": f">= {100 * TARGETS['llama_1b_mfu']:.0f}%",
                "met": None if mfu is None else mfu >= TARGETS["llama_1b_mfu"],
            }
        )
    return out


# -------------------------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps/calls after the warm-up")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any backend (checks the command)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument(
        "--json",
        default=None,
        help="output file (default benchmarks/gpu_bench.json; --smoke: gpu_bench_smoke.json in the temp directory)",
    )
    ap.add_argument(
        "--aot",
        metavar="TARGET",
        help="compile every part it would time for TARGET GPUs (h100, "
        "a100, h200) on this host, deviceless, instead of timing: one line per program, compiled OK or "
        "why not; exit 1 if any failed (default JSON: gpu_bench_aot_TARGET.json in the temp directory)",
    )
    ap.add_argument("--only", help="comma-separated train variant names (e.g. 'llama_1b,cola_1b'): only these")
    ap.add_argument(
        "--one-process",
        action="store_true",
        help="run the train variants in one process (compiles "
        "share XLA's autotuning: faster; the measured peak is then the process's)",
    )
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="after timing, trace each train variant's steps with "
        "jax.profiler: DIR/NAME.kernels.json (per-kernel device time) and DIR/NAME.hlo.txt.gz",
    )
    ap.add_argument("--profile-only", help="comma-separated train variant names: profile only these")
    ap.add_argument("--variants", help=argparse.SUPPRESS)  # internal: run these train variants, print JSON
    args = ap.parse_args(argv)
    if args.variants is not None:
        for spec in json.loads(args.variants):
            try:
                traced = (
                    args.profile
                    if args.profile and (not args.profile_only or spec["name"] in args.profile_only.split(","))
                    else None
                )
                print(
                    json.dumps({"name": spec["name"], **train_variant(spec, args.steps, args.smoke, traced)}),
                    flush=True,
                )
            except Exception as e:  # noqa: BLE001 - reported in the variant's row
                traceback.print_exc()
                print(json.dumps({"name": spec["name"], "error": _error(e)}), flush=True)
        return 0
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from {','.join(PARTS)}")
    if args.aot:
        return aot_main(args.aot, parts, args.smoke, args.json)
    import jax

    if jax.default_backend() == "cpu" and not args.smoke:
        print(
            "gpu_bench measures a GPU, and jax.default_backend() is 'cpu': run it on a GPU, or pass --smoke "
            "to check the command with tiny shapes here",
            file=sys.stderr,
        )
        return 1
    steps = 2 if args.smoke and args.steps == 10 else args.steps
    res: dict = {
        "smoke": args.smoke,
        "steps": steps,
        "parts": parts,
        "shapes": shapes(args.smoke),
        "targets_set": TARGETS,
    }
    runners = {
        "device": lambda: device_info(),
        "rmsnorm": lambda: rmsnorm_rows(steps, args.smoke),
        "attention": lambda: attention_rows(steps, args.smoke),
        "tests": lambda: kernel_tests(args.smoke),
    }
    path = args.json or (
        os.path.join(tempfile.gettempdir(), "gpu_bench_smoke.json")
        if args.smoke
        else os.path.join(HERE, "gpu_bench.json")
    )

    def save():  # after every part and variant: a run cut short (a lease running out) keeps what it measured
        res["targets"] = targets(res)
        if args.smoke:  # tiny shapes on whatever backend: no target is met or missed
            res["targets"] = [{**t, "met": "n/a (--smoke)"} for t in res["targets"]]
        with open(path, "w") as f:
            json.dump(res, f, indent=2, default=str)

    for part in parts:
        if part in TRAIN_PARTS:
            continue
        try:
            res[part] = runners[part]()
        except Exception as e:  # noqa: BLE001 - the part's row says what failed; the others run
            res[part] = {"error": _error(e)} if part in ("device", "tests") else [{"impl": part, "error": _error(e)}]
        save()
    only = {n.strip() for n in args.only.split(",")} if args.only else None
    specs = [s for s in train_variants(args.smoke) if s["part"] in parts and (only is None or s["name"] in only)]
    if only and only - {s["name"] for s in train_variants(args.smoke)}:
        ap.error(f"--only: unknown {sorted(only - {s['name'] for s in train_variants(args.smoke)})}")
    res["train"] = []

    def row_done(row):
        res["train"].append(row)
        save()
        print(
            f"  {row['variant']}: " + (f"{row['step_ms']:.1f} ms" if "step_ms" in row else row.get("error", "")),
            flush=True,
        )

    run_variants(
        specs, steps, args.smoke, args.one_process, args.profile, on_row=row_done, profile_only=args.profile_only
    )
    print_tables(res)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
