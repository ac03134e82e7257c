"""The training loop: loss falls, exact resume, signals, divergence and bad checkpoints."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from tests_support import metric_rows

from boost_jax import train
from boost_jax.config import base_config
from boost_jax.errors import CheckpointError, TrainingDiverged
from boost_jax.runtime.checkpoints.store import Checkpointer


def final_params(run_dir, step):
    ckpt = Checkpointer(Path(run_dir) / "checkpoints", keep=3, create=False)
    meta = ckpt.read_meta(step)
    from boost_jax.runtime.build import load_model

    model, _, _ = load_model(str(Path(run_dir) / "checkpoints" / str(step)))
    ckpt.close()
    from flax import nnx

    return meta, nnx.to_pure_dict(nnx.state(model))


def test_default_model_learns(tmp_path):
    cfg = base_config()  # the tiny CoLA default, shortened
    cfg.run_dir = str(tmp_path / "run")
    cfg.train.update(steps=60, warmup_steps=6, eval_every=60, eval_batches=4, progress=False)
    cfg.data.embedded_max_bytes = 1_000_000
    out = train.run(cfg)
    (s0, first), (s1, last) = out["evals"][0], out["evals"][-1]
    assert (s0, s1) == (0, 60)
    assert last < first - 1.5, out["evals"]
    rows = [json.loads(line) for line in open(out["metrics"])]
    logged = [r for r in rows if "loss" in r][-1]
    for key in ("loss", "perplexity", "grad_norm", "lr", "step_time_s", "tokens_per_s", "tflops_per_device"):
        assert key in logged and np.isfinite(logged[key])
    assert os.listdir(out["tensorboard"])
    assert Checkpointer(out["checkpoints"], keep=3, create=False).latest_step() == 60


@pytest.mark.parametrize("batching", ["stream", "packed", "document"])
def test_resume_continues_bit_for_bit(make_config, tmp_path, batching):
    straight = make_config(**{"run_dir": str(tmp_path / "a"), "train.log_every": 1, "data.batching": batching})
    train.run(straight)
    split = make_config(
        **{"run_dir": str(tmp_path / "b"), "train.log_every": 1, "train.stop_at_step": 4, "data.batching": batching}
    )
    out = train.run(split)
    assert out["step"] == 4
    split.train.stop_at_step = 0
    out = train.run(split)  # auto-resumes from step 4 in the same run dir
    assert out["step"] == 8
    a, b = metric_rows(tmp_path / "a"), metric_rows(tmp_path / "b")
    assert [a[s] for s in range(5, 9)] == [b[s] for s in range(5, 9)]
    meta_a, pa = final_params(tmp_path / "a", 8)
    meta_b, pb = final_params(tmp_path / "b", 8)
    assert meta_a["data_position"] == meta_b["data_position"] == 8 * 8
    assert meta_a["tokens_seen"] == meta_b["tokens_seen"] == metric_rows(tmp_path / "a", "tokens_seen")[8]
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resume_keeps_the_order_its_checkpoint_used(make_config, tmp_path, capsys):
    """A checkpoint's data position refers to the permutation that reached it (data.shuffle, or numpy
    for checkpoints written before it was recorded): a resume keeps it and says so."""
    straight = make_config(**{"run_dir": str(tmp_path / "a"), "train.log_every": 1, "data.shuffle": "numpy"})
    train.run(straight)
    split = make_config(
        **{"run_dir": str(tmp_path / "b"), "train.log_every": 1, "train.stop_at_step": 4, "data.shuffle": "numpy"}
    )
    train.run(split)
    resumed = make_config(**{"run_dir": str(tmp_path / "b"), "train.log_every": 1})  # data.shuffle=feistel
    train.run(resumed)
    assert "data.shuffle=numpy; continuing with it" in capsys.readouterr().out
    a, b = metric_rows(tmp_path / "a"), metric_rows(tmp_path / "b")
    assert [a[s] for s in range(5, 9)] == [b[s] for s in range(5, 9)]
    fresh = make_config(**{"run_dir": str(tmp_path / "c"), "train.log_every": 1})
    train.run(fresh)
    assert metric_rows(tmp_path / "c")[1] != a[1]  # new runs take the stateless order


def test_divergence_stops_and_keeps_last_good_checkpoint(make_config):
    cfg = make_config(
        **{
            "train.lr": 1e30,
            "train.warmup_steps": 0,
            "train.steps": 12,
            "checkpoint.every": 1,
            "train.grad_clip": 0.0,
            "train.eval_every": 0,
        }
    )
    with pytest.raises(
        TrainingDiverged,
        match=r"step (\d+): .*The last good checkpoint \(its state's "
        r"next step was finite\) is step (\d+)",
    ) as e:
        train.run(cfg)
    import re

    bad, good = map(int, re.search(r"step (\d+):.* is step (\d+) in", str(e.value)).groups())
    ckpt = Checkpointer(Path(cfg.run_dir) / "checkpoints", keep=3, create=False)
    assert ckpt.latest_step() == good == bad - 2  # bad-1's state computed the non-finite step: set aside
    assert (Path(cfg.run_dir) / "checkpoints" / f"{bad - 1}.diverged").is_dir()
    _, params = final_params(cfg.run_dir, good)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def _checkpoint_files(run_dir):
    return sorted(str(p) for p in (Path(run_dir) / "checkpoints").rglob("*"))


def test_incompatible_checkpoint_names_mismatch_and_is_kept(make_config):
    cfg = make_config()
    train.run(cfg)
    before = _checkpoint_files(cfg.run_dir)
    bigger = make_config(**{"model.d_model": 64})
    with pytest.raises(CheckpointError, match=r"does not fit this model[\s\S]*embed"):
        train.run(bigger)
    assert _checkpoint_files(cfg.run_dir) == before


def test_all_checkpoints_corrupt_is_a_clear_error_and_all_are_kept(make_config):
    cfg = make_config()
    train.run(cfg)
    for step in (4, 8):  # with one good step left, training falls back to it (tests/test_faults.py)
        for f in (Path(cfg.run_dir) / "checkpoints" / str(step) / "state").rglob("*"):
            if f.is_file():
                f.write_bytes(b"not a checkpoint")
    before = _checkpoint_files(cfg.run_dir)
    cfg.train.steps = 12
    with pytest.raises(CheckpointError, match=r"every checkpoint .* is damaged \(steps \[8, 4\]\); they were left"):
        train.run(cfg)
    assert _checkpoint_files(cfg.run_dir) == before


@pytest.mark.parametrize(
    "sig",
    [
        signal.SIGTERM,
        pytest.param(signal.SIGHUP, marks=pytest.mark.slow),
        pytest.param(signal.SIGUSR1, marks=pytest.mark.slow),
    ],
    ids=lambda s: s.name,
)
def test_stop_signals_save_and_exit_zero(tmp_path, sig):
    """SIGTERM (preemption), SIGHUP (the ssh session closed), SIGUSR1 (sbatch --signal, the template's)."""
    run_dir = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "boost_jax.train",
        f"--config.run_dir={run_dir}",
        "--config.train.steps=100000",
        "--config.train.log_every=1",
        "--config.train.eval_every=0",
        "--config.checkpoint.every=100000",
        "--config.train.progress=False",
        "--config.model.n_layers=1",
        "--config.train.global_batch=8",
        "--config.data.embedded_max_bytes=200000",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not ((run_dir / "metrics.jsonl").exists() and len(metric_rows(run_dir)) >= 3):
        time.sleep(0.5)
    assert proc.poll() is None, proc.stdout.read()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    import re

    stopped_at = int(re.search(rf"stopped by {sig.name} at step (\d+)", out).group(1))
    assert stopped_at >= 3
    assert Checkpointer(run_dir / "checkpoints", keep=3, create=False).latest_step() == stopped_at


def test_restore_from_another_run(make_config, tmp_path):
    first = make_config(**{"run_dir": str(tmp_path / "a"), "train.stop_at_step": 4})
    train.run(first)
    second = make_config(**{"run_dir": str(tmp_path / "b"), "restore_from": str(tmp_path / "a")})
    out = train.run(second)
    assert out["evals"][0][0] == 4 and out["step"] == 8  # started at the restored step
    with pytest.raises(CheckpointError, match="restore_from"):
        train.run(make_config(**{"run_dir": str(tmp_path / "c"), "restore_from": str(tmp_path / "nowhere")}))


def test_tied_embeddings_train(make_config):
    out = train.run(make_config(**{"model.tie_embeddings": True, "train.eval_every": 0}))
    assert out["step"] == 8
    assert out["evals"] == [] and not metric_rows(out["run_dir"], "eval_loss")  # eval_every=0: none, not even step 0


def test_profile_steps_and_compile_cache(make_config, tmp_path):
    """profile_steps=2,3 leaves a jax.profiler trace in RUN_DIR/tensorboard; compile_cache fills the
    directory with the run's compiled programs (every program: the compile-time floor is lowered)."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    cache = tmp_path / "xla_cache"
    cfg = make_config(**{"train.steps": 3, "train.eval_every": 0, "profile_steps": "2,3", "compile_cache": str(cache)})
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        summary = train.run(cfg)
    finally:  # the rest of the session runs without a persistent cache, as before
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
        cc.set_cache_dir(before[0])
        cc.reset_cache()
    assert summary["step"] == 3
    traces = list((Path(cfg.run_dir) / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0, traces
    assert any(p.is_file() and p.stat().st_size > 0 for p in cache.rglob("*")), list(cache.rglob("*"))


@pytest.mark.parametrize("value", ["3,2", "0,1", "a,b", "1,2,3"])
def test_bad_profile_steps_name_the_field(make_config, value):
    from boost_jax.errors import ConfigError
    from boost_jax.validate import validate

    with pytest.raises(ConfigError, match="profile_steps.*A,B"):
        validate(make_config(profile_steps=value))
    validate(make_config(profile_steps="4"))  # one step
