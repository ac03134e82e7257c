"""The launch scripts: shell syntax, argument checks, and the SLURM template's XLA flags exist."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "launch" / "slurm" / "train.sbatch"
LOCAL = ROOT / "launch" / "local_multiprocess.sh"


def test_scripts_parse():
    for script in (SBATCH, LOCAL):
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_local_launcher_rejects_a_bad_process_count():
    out = subprocess.run(["bash", str(LOCAL), "two"], capture_output=True, text=True)
    assert out.returncode == 2 and "usage:" in out.stderr


def test_sbatch_xla_flags_are_known_to_xla():
    # XLA aborts on an unknown flag in XLA_FLAGS, whatever the backend: a renamed flag fails here.
    flags = re.findall(r"^\s*(?:#\s*)?(--xla_\S+)", SBATCH.read_text(), flags=re.M)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags and len(flags) >= 8
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(jnp.ones(2).sum())"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "2.0" in out.stdout, out.stderr[-2000:]
