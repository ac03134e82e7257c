"""The wheel a user installs: built from a copy of this checkout, installed into a fresh virtual
environment (its dependencies from this interpreter's site-packages, in a venv or not:
tests_support.fresh_venv; the wheel itself `--no-deps`, so nothing but the build backend comes from
the package index), and the
README's first command run there from a directory that is not a checkout: the packaged configs, the
console scripts and `python -m` all work without the repository."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests_support import fresh_venv

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, cwd, env, timeout=600):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy: building writes build/ and *.egg-info next to the sources
    shutil.copytree(
        ROOT,
        src,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".git", "runs", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".whl", "hf", ".ci"
        ),
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"), str(src)], tmp, env)
    wheel = next((tmp / "dist").glob("boost_jax-*.whl"))
    python = fresh_venv(tmp / "venv", env)
    _run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], tmp, env)
    work = tmp / "work"  # not a checkout: no configs/ here
    work.mkdir()
    return python, work, env


def test_wheel_runs_the_first_command(venv):
    python, work, env = venv
    where = _run(
        [
            str(python),
            "-c",
            """
import importlib.metadata as md, boost_jax
from boost_jax.config import config_path
scripts = sorted(ep.name for ep in md.entry_points(group="console_scripts") if ep.name.startswith("boost-")
                 and ep.load())
print(boost_jax.__file__, config_path("cola_60m"), config_path("configs/llama_1b.py"), *scripts)
""",
        ],
        work,
        env,
    ).split()
    site = str(python.parents[1])
    assert where[0].startswith(site), where  # the installed wheel, not this checkout
    assert where[1].startswith(site) and where[1].endswith("boost_jax/configs/cola_60m.py"), where
    assert where[2].endswith("boost_jax/configs/llama_1b.py"), where  # the README's spelling, no checkout here
    assert where[3:] == ["boost-eval", "boost-export", "boost-generate", "boost-plan", "boost-prepare", "boost-train"]
    assert all((python.parent / name).is_file() for name in where[3:])
    printed = _run([str(python.parent / "boost-train"), "--config", "cola_60m", "--print_config"], work, env)
    assert "batching: document" in printed and "d_model: 512" in printed
    # The README's first command (`python -m boost_jax.train`), stopped at step 2 of the same schedule,
    # on one CPU device as on a user's machine.
    one = dict(env, XLA_FLAGS=" ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f))
    out = _run(
        [str(python), "-m", "boost_jax.train", "--config.train.stop_at_step=2", "--config.train.progress=false"],
        work,
        one,
    )
    assert "cola model" in out and "boost_jax/configs/tiny.py" in out and "eval loss" in out, out
    assert (work / "runs" / "tiny" / "checkpoints" / "2").is_dir()
