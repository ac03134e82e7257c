"""Two processes x 4 emulated CPU devices (jax.distributed, gloo) train like one process x 8 devices,
survive a SIGKILL of one process (the last finished checkpoint restores), and resume exactly."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from boost_jax.config import base_config
from boost_jax.errors import DistributedError
from boost_jax.runtime import distributed

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch" / "local_multiprocess.sh"
TIMEOUT_S = 180  # per launch: a hung collective fails the test instead of hanging CI
# tests/conftest.py's small_config as flags; tensor=4 must divide the heads, so n_kv_heads=4.
SMALL = [
    "--config.model.d_model=32",
    "--config.model.n_layers=2",
    "--config.model.n_heads=4",
    "--config.model.n_kv_heads=4",
    "--config.model.d_ff=64",
    "--config.model.rank=8",
    "--config.model.max_seq_len=32",
    "--config.train.seq_len=16",
    "--config.train.global_batch=8",
    "--config.train.warmup_steps=2",
    "--config.train.log_every=1",
    "--config.train.eval_every=0",
    "--config.train.eval_batches=2",
    "--config.train.progress=False",
    "--config.checkpoint.every=3",
    "--config.checkpoint.keep=10",
    "--config.data.embedded_max_bytes=200000",
    "--config.parallel.data=2",
    "--config.parallel.tensor=4",
    "--config.parallel.strategy=btp",
]
STEPS = 60  # the schedule; runs stop early with train.stop_at_step


def _env(**extra) -> dict:
    """This environment minus the test's own device count and any BOOST_* (the launcher sets them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOOST_")}
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


@pytest.fixture
def spawn():
    """Start commands in their own process groups; kill any group still alive at teardown."""
    procs = []

    def start(cmd, env, log: Path):
        proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _tail(*paths: Path, n=3000) -> str:
    return "\n".join(f"--- {p}\n{p.read_text()[-n:]}" for p in paths if p.exists())


def _finish(proc, logs) -> int:
    try:
        return proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"timed out after {TIMEOUT_S}s (a hung collective?):\n{_tail(*logs)}")


def _losses(run_dir: Path) -> dict:
    """{step: loss}; a later row for a step (from a resumed run) replaces an earlier one. A line cut
    short by the SIGKILL is skipped."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in row:
            out[row["step"]] = row["loss"]
    return out


def _finished_steps(ckpt_dir: Path) -> list[int]:
    # Orbax writes into `<step>.orbax-checkpoint-tmp-*` and renames to `<step>` once every process is done.
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) if ckpt_dir.is_dir() else []


def test_two_processes_match_one_survive_a_kill_and_resume(tmp_path, spawn):
    run, logs = tmp_path / "mp", tmp_path / "logs"
    launch = ["bash", str(LAUNCH), "2", *SMALL, f"--config.run_dir={run}", f"--config.train.steps={STEPS}"]
    env = _env(DEVICES_PER_PROCESS="4", RUN_LOG_DIR=str(logs), KILL_GRACE_S="5")
    proc_logs = [logs / "process_0.log", logs / "process_1.log", tmp_path / "launch1.log"]

    # 1. Train on 2 processes; SIGKILL process 1 as soon as the first checkpoint is finished.
    launcher = spawn(launch, env, tmp_path / "launch1.log")
    deadline = time.time() + TIMEOUT_S
    while not _finished_steps(run / "checkpoints"):
        assert launcher.poll() is None, f"run ended before its first checkpoint:\n{_tail(*proc_logs)}"
        assert time.time() < deadline, f"no checkpoint after {TIMEOUT_S}s:\n{_tail(*proc_logs)}"
        time.sleep(0.1)
    os.kill(int((logs / "process_1.pid").read_text()), signal.SIGKILL)
    assert _finish(launcher, proc_logs) != 0  # the launcher reports the failure and stops process 0
    done = _finished_steps(run / "checkpoints")[-1]
    assert 3 <= done < STEPS, done

    # The last finished checkpoint restores (params only, one device) despite the killed run.
    from flax import nnx

    from boost_jax.runtime.build import load_model

    model, cfg, _ = load_model(str(run / "checkpoints" / str(done)))
    assert cfg.parallel.strategy == "btp" and cfg.model.n_layers == 2
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model)))

    # 2. A second launch in the same run dir resumes from it and trains 3 more steps.
    end = done + 3
    launcher = spawn([*launch, f"--config.train.stop_at_step={end}"], env, tmp_path / "launch2.log")
    assert _finish(launcher, proc_logs) == 0, _tail(*proc_logs)
    assert f"restored step {done}" in (logs / "process_0.log").read_text()

    # 3. The same run on one process with 8 devices: the losses agree step for step.
    single = tmp_path / "single"
    cmd = [
        sys.executable,
        "-m",
        "boost_jax.train",
        *SMALL,
        f"--config.run_dir={single}",
        f"--config.train.steps={STEPS}",
        f"--config.train.stop_at_step={end}",
    ]
    proc = spawn(cmd, _env(XLA_FLAGS="--xla_force_host_platform_device_count=8"), tmp_path / "single.log")
    assert _finish(proc, [tmp_path / "single.log"]) == 0, _tail(tmp_path / "single.log")
    multi, one = _losses(run), _losses(single)
    assert set(range(1, end + 1)) <= set(multi) and set(one) == set(range(1, end + 1))
    for step in range(1, end + 1):
        np.testing.assert_allclose(multi[step], one[step], rtol=1e-5, err_msg=f"step {step}")


def _cfg(**distributed_fields):
    c = base_config()
    c.distributed.update(distributed_fields)
    return c


def test_distributed_settings_from_config_env_and_slurm(monkeypatch):
    for var in ("BOOST_COORDINATOR", "BOOST_NUM_PROCESSES", "BOOST_PROCESS_ID", "SLURM_JOB_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    assert distributed.settings(_cfg()) is None  # nothing set: one process
    monkeypatch.setenv("BOOST_COORDINATOR", "10.0.0.1:1234")
    monkeypatch.setenv("BOOST_NUM_PROCESSES", "4")
    monkeypatch.setenv("BOOST_PROCESS_ID", "2")
    assert distributed.settings(_cfg()) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 2}
    assert distributed.settings(_cfg(process_id=3))["process_id"] == 3  # the config wins
    with pytest.raises(DistributedError, match=r"distributed\.process_id.*outside"):
        distributed.settings(_cfg(process_id=4))
    monkeypatch.delenv("BOOST_COORDINATOR")
    with pytest.raises(DistributedError, match=r"distributed\.coordinator_address.*BOOST_COORDINATOR"):
        distributed.settings(_cfg())
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert distributed.settings(_cfg())["coordinator_address"] is None  # SLURM fills in the rest
    for var in ("BOOST_NUM_PROCESSES", "BOOST_PROCESS_ID"):
        monkeypatch.delenv(var)
    assert distributed.settings(_cfg()) == {}  # initialize() with no arguments: JAX reads SLURM
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert distributed.settings(_cfg()) is None  # a one-task allocation is a single process
    with pytest.raises(DistributedError, match="cpu_collectives"):
        distributed.maybe_initialize(
            _cfg(coordinator_address="127.0.0.1:1", num_processes=2, process_id=0, cpu_collectives="nccl")
        )
