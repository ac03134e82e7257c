"""The launch scripts: shell syntax, argument checks, and the SLURM template's XLA flags exist."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "launch" / "slurm" / "train.sbatch"
LOCAL = ROOT / "launch" / "local_multiprocess.sh"
GPU_ALL = ROOT / "benchmarks" / "gpu_all.sh"


def test_scripts_parse():
    for script in (SBATCH, LOCAL, GPU_ALL):
        subprocess.run(["bash", "-n", str(script)], check=True)
    # gpu_all.sh's parts are gpu_bench.py's (a renamed part would only fail on a GPU)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_bench

    named = re.findall(r"--parts (\S+)", GPU_ALL.read_text())
    assert named and {p for arg in named for p in arg.split(",")} <= set(gpu_bench.PARTS)


def test_local_launcher_rejects_a_bad_process_count():
    out = subprocess.run(["bash", str(LOCAL), "two"], capture_output=True, text=True)
    assert out.returncode == 2 and "usage:" in out.stderr


def test_xla_gpu_flags_are_known_to_xla():
    # XLA aborts on an unknown flag in XLA_FLAGS, whatever the backend: a renamed flag fails here.
    from boost_jax import xla_gpu_flags as G

    flags = [f for f, _ in G.FLAGS + G.MEASURE]
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags and len(flags) >= 8
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", "import jax.numpy as jnp; print(jnp.ones(2).sum())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "2.0" in out.stdout, out.stderr[-2000:]


def test_sbatch_takes_its_xla_flags_from_the_one_module():
    text = SBATCH.read_text()
    assert 'XLA_FLAGS="$(python -m boost_jax.xla_gpu_flags)"' in text
    assert not re.findall(r"^\s*(?:#\s*)?--xla_gpu\S+", text, flags=re.M)  # no second list to drift


def test_xla_gpu_flags_keep_the_users_values_and_apply_only_for_a_gpu(monkeypatch):
    from boost_jax import xla_gpu_flags as G

    user = "--xla_dump_to=/tmp/d --xla_gpu_enable_latency_hiding_scheduler=false"
    value, added = G.merged(user)
    assert value.startswith(user) and "--xla_gpu_enable_latency_hiding_scheduler=true" not in value
    assert len(added) == len(G.FLAGS) - 1 and all(f in value for f in added)
    # The command line prints the same merge (what the SLURM template exports).
    out = subprocess.run(
        [sys.executable, "-m", "boost_jax.xla_gpu_flags"],
        env={**os.environ, "XLA_FLAGS": user},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0 and out.stdout.strip() == value, out.stderr
    # apply(): only when a CUDA jax is installed and JAX_PLATFORMS allows GPUs, never twice.
    monkeypatch.setattr(G, "_backends_started", lambda: False)
    env = {"XLA_FLAGS": user, "JAX_PLATFORMS": "cpu"}
    assert G.apply(env)[0] == [] and env["XLA_FLAGS"] == user
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name in G.CUDA_PLUGINS else None)
    monkeypatch.setattr(G, "NVIDIA_DRIVER", ())  # a plugin without a driver (the aot extra on a CPU host): no
    env = {"XLA_FLAGS": user}
    assert G.apply(env)[0] == [] and env["XLA_FLAGS"] == user
    monkeypatch.setattr(G, "NVIDIA_DRIVER", (__file__,))  # a driver is loaded
    assert G.apply(env)[0] == added and env["XLA_FLAGS"] == value
    assert G.apply(env) == ([], "XLA_FLAGS already names every flag")
    monkeypatch.setattr(G, "_backends_started", lambda: True)
    env = {}
    assert G.apply(env)[0] == [] and "XLA_FLAGS" not in env
    # A step built for GPU devices carries the same flags as compiler options, less those XLA_FLAGS names.
    options = G.compiler_options({"XLA_FLAGS": user})
    assert sorted(options) == sorted(f.split("=")[0].lstrip("-") for f in added)
    assert options["xla_gpu_enable_pipelined_all_gather"] is True and "xla_gpu_enable_command_buffer" not in options


def test_compiler_options_this_xla_lacks_are_dropped_not_fatal():
    # jax 0.11.2's XLA retired the pipelined-collective options: as XLA_FLAGS they still parse (no-ops),
    # as per-program options they failed every GPU step's compile. accepted() probes and drops them.
    import jax
    import jax.numpy as jnp

    from boost_jax import xla_gpu_flags as G

    dev = jax.devices("cpu")[0]
    real = G.compiler_options({})
    retired = {"xla_gpu_enable_no_such_option_a": True, "xla_gpu_no_such_option_b": 7}
    with pytest.warns(UserWarning, match="xla_gpu_enable_no_such_option_a, xla_gpu_no_such_option_b"):
        kept = G.accepted({**real, **retired}, dev)
    assert kept == real  # every option of this jaxlib kept, with its value; the unknown ones gone
    one = jax.ShapeDtypeStruct((2,), jnp.float32)
    jax.jit(lambda a: a * 2, compiler_options=kept).lower(one).compile()  # compiles with what is left
    with pytest.raises(Exception, match="No such compile option"):
        jax.jit(lambda a: a * 2, compiler_options={**kept, **retired}).lower(one).compile()
    assert G.accepted({}, dev) == {}


def test_gemm_options_turn_triton_gemms_off_for_widths_its_tiles_cannot_split():
    """A width that is neither a multiple of 64 nor a divisor of 64 (head_dim 100, a tensor-train mode
    of 18 or 12) sends the program's GEMMs to cuBLAS; tileable widths keep Triton's; XLA_FLAGS naming
    the flag wins either way. The zoo: cola_3b, llama_3b and tt_60m/350m/1b only."""
    from boost_jax import xla_gpu_flags as G
    from boost_jax.config import sized_config, tt_config
    from boost_jax.model.transformer import split_widths

    assert [w for w in range(1, 257) if G.triton_tiles(w)] == [1, 2, 4, 8, 16, 32, 64, 128, 192, 256]
    off = {G.TRITON_GEMM: False}
    assert G.gemm_options({"head_dim": 64, "mode": 8}, {}) == {}
    assert G.gemm_options({"head_dim": 100}, {}) == off
    assert G.gemm_options({"head_dim": 100}, {"XLA_FLAGS": f"--{G.TRITON_GEMM}=true"}) == {}
    for size, want in (("1b", {}), ("3b", off), ("7b", {})):
        for linear in ("cola", "dense"):
            assert G.gemm_options(split_widths(sized_config(size, linear).model), {}) == want, (size, linear)
    for size, want in (("60m", off), ("130m", {}), ("350m", off), ("1b", off)):
        assert G.gemm_options(split_widths(tt_config(size).model), {}) == want, size
