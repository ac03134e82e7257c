"""Fault injection: signals during a save, SIGKILL, failed saves, NaN steps, bit rot, two trainers.

Each test checks the exit status, the message, what is on disk, and that training resumed after the
fault continues the loss curve of an uninterrupted reference run bit for bit.
"""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tests_support import metric_rows

from boost_jax import train
from boost_jax.config import base_config
from boost_jax.errors import CheckpointError, ConfigError, CorruptCheckpoint, RunDirBusy, TrainingDiverged
from boost_jax.runtime import step as step_lib
from boost_jax.runtime.checkpoints.store import Checkpointer, fingerprint

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- helpers


def cli_flags(cfg) -> list[str]:
    """--config.* flags that rebuild cfg from the defaults (for a trainer in a subprocess)."""

    def flat(tree, prefix=""):
        for k, v in tree.items():
            yield from flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + k, v)]

    base = dict(flat(base_config().to_dict()))
    return [f"--config.{k}={v}" for k, v in flat(cfg.to_dict()) if base[k] != v]


def spawn(cfg):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "boost_jax.train", *cli_flags(cfg)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_rows(proc, run_dir, n, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        if (Path(run_dir) / "metrics.jsonl").exists() and len(metric_rows(run_dir)) >= n:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{run_dir}: fewer than {n} logged steps after {timeout}s")


def signal_repeatedly(proc, sig, times, gap):
    for _ in range(times):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            return
        time.sleep(gap)


def steps_on_disk(run_dir):
    d = Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit())


def tmp_dirs(run_dir):
    return sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir() if "orbax-checkpoint-tmp" in p.name)


def saved_state(run_dir, step, cfg):
    """The raw state arrays of a checkpoint (restored and verified on one device)."""
    from boost_jax.parallel.mesh import ONE_DEVICE
    from boost_jax.runtime.build import build
    from boost_jax.runtime.checkpoints.store import restore

    one = cfg.copy_and_resolve_references()
    one.parallel.update(ONE_DEVICE)
    got = restore(str(Path(run_dir) / "checkpoints"), build(one, jax.devices()[:1]).spec.abstract, step=step)
    return jax.tree.map(np.asarray, got.state), got.meta


def assert_same_states(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def continues_reference(run_dir, ref_dir, steps, cfg):
    """The loss rows of `steps` and the final checkpoint agree bit for bit with the reference run."""
    got, want = metric_rows(run_dir), metric_rows(ref_dir)
    assert [got[s] for s in steps] == [want[s] for s in steps]
    assert_same_states(saved_state(run_dir, steps[-1], cfg)[0], saved_state(ref_dir, steps[-1], cfg)[0])


def long_config(make_config, run_dir, **kw):
    """A run that lasts until it is stopped (the schedule is long; steps take milliseconds)."""
    return make_config(
        **{
            "run_dir": str(run_dir),
            "model.n_layers": 1,
            "train.steps": 100000,
            "train.log_every": 1,
            "train.eval_every": 0,
            "checkpoint.async_save": True,
            **kw,
        }
    )


def flip_bits(step_dir: Path, stride: int):
    """Flip one bit in every `stride`-th byte of a checkpoint's array data files."""
    for f in sorted((step_dir / "state").rglob("*")):
        if f.is_file() and f.parent.name == "d":
            b = bytearray(f.read_bytes())
            for i in range(stride // 2, len(b), stride):
                b[i] ^= 0x10
            f.write_bytes(bytes(b))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 12-step run (loss logged every step, checkpoints every 4) and its config maker."""
    from conftest import small_config

    def make(run_dir, **kw):
        return small_config(
            run_dir, **{"train.steps": 12, "train.log_every": 1, "train.eval_every": 0, "checkpoint.keep": 10, **kw}
        )

    ref_dir = tmp_path_factory.mktemp("reference") / "run"
    train.run(make(ref_dir))
    return ref_dir, make


# ---------------------------------------------------------------- checksums


def test_checksum_is_sharding_independent_and_sees_one_bit():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    h = jnp.asarray(rng.standard_normal((4, 8)), jnp.bfloat16)
    words = x.view(np.uint32).astype(np.uint64).ravel()
    expect = int((words * (2 * np.arange(words.size, dtype=np.uint64) + 1)).sum() % 2**32)  # numpy reference
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    one, _ = fingerprint({"x": jnp.asarray(x), "h": h, "n": jnp.int32(7)})
    sharded, bad = fingerprint(
        {
            "x": jax.device_put(x, NamedSharding(mesh, P("a", "b"))),
            "h": jax.device_put(h, NamedSharding(mesh, P(None, "b"))),
            "n": jnp.int32(7),
        }
    )
    assert one == sharded and one["['x']"] == expect and bad == []
    for flat in rng.choice(x.size, 5, replace=False):
        y = x.copy()
        y.reshape(-1).view(np.uint32)[flat] ^= np.uint32(1 << int(rng.integers(32)))
        assert fingerprint({"x": jnp.asarray(y)})[0]["['x']"] != expect
    y = x.copy()
    y[3, 2] = np.inf
    assert fingerprint({"x": jnp.asarray(y), "n": jnp.int32(1)})[1] == ["['x']"]


def test_bit_flips_never_restore_silently(reference, tmp_path):
    ref_dir, make = reference
    cfg = make(ref_dir)
    want, _ = saved_state(ref_dir, 12, cfg)
    files = [
        f for f in sorted((ref_dir / "checkpoints" / "12" / "state").rglob("*")) if f.is_file() and f.parent.name == "d"
    ]
    detected = 0
    for k in range(8):  # one bit in one byte, at spread-out places of the data files
        run = tmp_path / f"flip{k}"
        shutil.copytree(ref_dir / "checkpoints", run / "checkpoints")
        f = run / files[k % len(files)].relative_to(ref_dir)
        b = bytearray(f.read_bytes())
        b[(len(b) * (2 * k + 1)) // 16] ^= 1 << (k % 8)
        f.write_bytes(bytes(b))
        try:
            got, _ = saved_state(run, 12, cfg)
        except CorruptCheckpoint as e:
            assert "left untouched" in str(e)
            detected += 1
            continue
        assert_same_states(got, want)  # restored without error only if the flip hit unused bytes
    assert detected >= 1


# ---------------------------------------------------------------- signals, SIGKILL, two trainers


def test_repeated_sigterm_during_the_save_is_absorbed(make_config, tmp_path):
    cfg = long_config(make_config, tmp_path / "run", **{"checkpoint.every": 100000})
    proc = spawn(cfg)
    wait_for_rows(proc, cfg.run_dir, 3)
    signal_repeatedly(proc, signal.SIGTERM, 40, 0.05)  # as Slurm or Kubernetes may do
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "SIGTERM again: still stopping" in out
    stopped = int(re.search(r"stopped by SIGTERM at step (\d+)", out).group(1))
    assert steps_on_disk(cfg.run_dir) == [stopped] and tmp_dirs(cfg.run_dir) == []
    # Resuming continues an uninterrupted run bit for bit (same schedule, same data positions).
    cfg.train.stop_at_step = stopped + 2
    train.run(cfg)
    ref = long_config(make_config, tmp_path / "ref", **{"checkpoint.every": 100000, "train.stop_at_step": stopped + 2})
    train.run(ref)
    continues_reference(cfg.run_dir, ref.run_dir, [stopped + 1, stopped + 2], cfg)


def test_sigkill_mid_save_second_trainer_and_triple_sigint(make_config, tmp_path):
    """A second trainer on a live run_dir stops at once; SIGKILL at two points of the async saves and
    a third SIGINT each leave only complete checkpoints (plus tmp dirs that the next start removes),
    and resuming from them continues the reference curve."""
    ends = []
    for k, fault in enumerate(("kill", "kill", "sigint")):
        cfg = long_config(make_config, tmp_path / f"run{k}", **{"checkpoint.every": 1, "checkpoint.keep": 100})
        proc = spawn(cfg)
        wait_for_rows(proc, cfg.run_dir, 3 + 2 * k)
        if k == 0:
            with pytest.raises(RunDirBusy, match=rf"is in use by a trainer on host .* pid {proc.pid} "):
                train.run(cfg)
        if fault == "kill":
            time.sleep(0.1 * k)
            proc.kill()
        else:
            signal_repeatedly(proc, signal.SIGINT, 3, 0.01)
        out, _ = proc.communicate(timeout=300)
        if fault == "kill":
            assert proc.returncode == -signal.SIGKILL
        elif proc.returncode == 130:  # the third SIGINT came before the save finished
            resume = re.search(r"SIGINT a third time: exiting .* a rerun resumes from step (\d+)", out)
            assert resume and int(resume.group(1)) == max(steps_on_disk(cfg.run_dir)), out
        else:  # the save finished first: a normal stop
            assert proc.returncode == 0 and "stopped by SIGINT" in out, out
        last = max(steps_on_disk(cfg.run_dir))
        meta = saved_state(cfg.run_dir, last, cfg)[1]  # every finalized step is complete and verified
        assert meta["step"] == last and meta["data_position"] == last * cfg.train.global_batch
        cfg.train.stop_at_step = last + 2  # the lock died with its holder: this takes it over
        train.run(cfg)
        assert tmp_dirs(cfg.run_dir) == []
        ends.append((cfg.run_dir, last))
    ref = long_config(
        make_config,
        tmp_path / "ref",
        **{"checkpoint.every": 1, "checkpoint.keep": 100, "train.stop_at_step": max(e for _, e in ends) + 2},
    )
    train.run(ref)
    for run_dir, last in ends:
        continues_reference(run_dir, ref.run_dir, [last + 1, last + 2], cfg)


# ---------------------------------------------------------------- failed saves


def disk_full_at(monkeypatch, step: int) -> None:
    """Orbax's final rename of checkpoint `step` fails as on a full disk (the async save's last act)."""
    from orbax.checkpoint._src.path import async_path

    rename = async_path.rename

    async def disk_full(src, dst):
        if Path(dst).name == str(step):
            raise OSError(errno.ENOSPC, "No space left on device")
        return await rename(src, dst)

    monkeypatch.setattr(async_path, "rename", disk_full)


def test_failed_async_save_stops_at_once_and_cleans_up(reference, tmp_path, monkeypatch):
    ref_dir, make = reference
    disk_full_at(monkeypatch, 8)
    cfg = make(tmp_path / "run", **{"checkpoint.async_save": True})
    with pytest.raises(
        CheckpointError,
        match=r"saving step 8 failed: No space left on device \[ENOSPC\] \(OSError: \[Errno 28\] No space left on "
        r"device\); its partial files were removed; the last good "
        r"checkpoint is step 4",
    ):
        train.run(cfg)
    # It stopped at the first step (or, at the latest, the next save) after the failure became known.
    assert steps_on_disk(cfg.run_dir) == [4] and tmp_dirs(cfg.run_dir) == []
    monkeypatch.undo()
    train.run(cfg)  # resumes from 4
    continues_reference(cfg.run_dir, ref_dir, list(range(5, 13)), cfg)


def test_nonfinite_state_is_never_saved(make_config):
    cfg = make_config(**{"checkpoint.every": 1})
    ckpt = Checkpointer(Path(cfg.run_dir) / "checkpoints", keep=3, async_save=False)
    state = {
        "params": {"w": jnp.ones((4, 4)).at[1, 2].set(jnp.nan)},
        "opt_state": (jnp.zeros(3),),
        "step": jnp.int32(1),
    }
    with pytest.raises(CheckpointError, match=r"not saving step 1: NaN/inf in \['params'\]\['w'\]"):
        ckpt.save(1, state, {}, force=True)
    ckpt.close()
    assert ckpt.all_steps() == []


# ---------------------------------------------------------------- NaN steps


def poison_step(monkeypatch, cfg, step):
    """Make the loss NaN on exactly the batch that train step `step` consumes."""
    from boost_jax.data import build_loaders

    bad = jnp.asarray(build_loaders(cfg)[0].batch((step - 1) * cfg.train.global_batch))
    real = step_lib.next_token_loss

    def loss(graphdef, params, tokens, **kw):
        # Every row is one of that batch's rows (a data replica may see only its share of the rows).
        hit = jnp.all(jnp.any(jnp.all(tokens[:, None, :] == bad[None, :, :], axis=-1), axis=-1))
        return real(graphdef, params, tokens, **kw) * jnp.where(hit, jnp.nan, 1.0)

    monkeypatch.setattr(step_lib, "next_token_loss", loss)


def test_transient_nan_is_skipped_and_resume_stays_consistent(reference, tmp_path, monkeypatch):
    _, make = reference
    straight = make(tmp_path / "a", **{"train.nonfinite": "skip", "checkpoint.every": 1, "train.steps": 8})
    poison_step(monkeypatch, straight, 5)
    out = train.run(straight)
    assert out["step"] == 8 and out["skipped_steps"] == 1
    s4, m4 = saved_state(straight.run_dir, 4, straight)
    s5, m5 = saved_state(straight.run_dir, 5, straight)
    assert_same_states({k: s4[k] for k in ("params", "opt_state")}, {k: s5[k] for k in ("params", "opt_state")})
    assert (int(s5["step"]), m5["data_position"], m5["skipped_steps"]) == (5, 5 * 8, 1)
    rows = [json.loads(line) for line in open(Path(straight.run_dir) / "metrics.jsonl")]
    assert [r["skipped_steps"] for r in rows if "loss" in r or "skipped_steps" in r][-1] == 1
    assert not any("loss" in r for r in rows if r["step"] == 5)  # NaN is not written (nor valid JSON)
    # The same run stopped at 6 and resumed: the labels, data and optimizer steps line up.
    split = make(
        tmp_path / "b", **{"train.nonfinite": "skip", "checkpoint.every": 1, "train.steps": 8, "train.stop_at_step": 6}
    )
    train.run(split)
    split.train.stop_at_step = 0
    assert train.run(split)["skipped_steps"] == 1
    continues_reference(split.run_dir, straight.run_dir, [7, 8], split)


def test_nan_under_stop_names_the_step_and_saves_nothing_after_it(reference, tmp_path, monkeypatch):
    _, make = reference
    cfg = make(tmp_path / "run", **{"train.log_every": 3})  # the NaN step 5 is neither logged nor saved
    poison_step(monkeypatch, cfg, 5)
    with pytest.raises(
        TrainingDiverged,
        match=r"step 5: loss nan, grad norm nan or the updated weights "
        r"not finite; stopping \(train.nonfinite=stop\)\. No good "
        r"checkpoint is left",
    ):
        train.run(cfg)
    # Step 4's state computed the non-finite step 5: set aside, never deleted; nothing after it saved.
    assert steps_on_disk(cfg.run_dir) == [] and (Path(cfg.run_dir) / "checkpoints" / "4.diverged").is_dir()


# ---------------------------------------------------------------- corruption


def test_corrupt_latest_falls_back_to_newest_good_step(reference, tmp_path, capsys):
    ref_dir, make = reference
    cfg = make(tmp_path / "run", **{"train.stop_at_step": 8})
    train.run(cfg)
    flip_bits(Path(cfg.run_dir) / "checkpoints" / "8", 97)
    damaged = sorted(
        str(p.relative_to(Path(cfg.run_dir) / "checkpoints" / "8"))
        for p in (Path(cfg.run_dir) / "checkpoints" / "8").rglob("*")
    )
    cfg.train.stop_at_step = 0
    capsys.readouterr()
    train.run(cfg)
    out = capsys.readouterr().out
    assert re.search(r"checkpoints/8 aside to .*checkpoints/8\.corrupt", out), out
    assert "falling back to step 4" in out and "restored step 4" in out
    aside = Path(cfg.run_dir) / "checkpoints" / "8.corrupt"
    assert sorted(str(p.relative_to(aside)) for p in aside.rglob("*")) == damaged  # kept, not deleted
    continues_reference(cfg.run_dir, ref_dir, list(range(5, 13)), cfg)
    # Going back to step 4 by hand in the same run_dir: the later steps are renamed, not in the way.
    cfg.restore_from = str(Path(cfg.run_dir) / "checkpoints" / "4")
    cfg.train.eval_every = 6  # a changed setting is announced, and the old config.json kept
    train.run(cfg)
    out = capsys.readouterr().out
    assert "note: resuming with a changed config (train.eval_every: 0 -> 6)" in out, out
    assert json.loads((Path(cfg.run_dir) / "config.before_step4.json").read_text())["train"]["eval_every"] == 0
    assert sorted(p.name for p in (Path(cfg.run_dir) / "checkpoints").iterdir()) == [
        "12",
        "12.superseded",
        "4",
        "8",
        "8.corrupt",
        "8.superseded",
    ]
    continues_reference(cfg.run_dir, ref_dir, list(range(5, 13)), cfg)


def test_tools_refuse_damaged_or_nonfinite_weights(reference, tmp_path, capsys):
    """A damaged step named as DIR/STEP, or a run whose only step is not finite, is refused (a run dir
    with an intact older step falls back to it: test_evaluate_falls_back_like_training)."""
    from boost_jax import evaluate, export, generate

    ref_dir, make = reference
    bad = tmp_path / "bad"
    shutil.copytree(ref_dir / "checkpoints", bad / "checkpoints")
    flip_bits(bad / "checkpoints" / "12", 97)
    bad = bad / "checkpoints" / "12"
    nan = tmp_path / "nan"  # a checkpoint written without the finite check (as older versions could)
    state, meta = saved_state(ref_dir, 12, make(ref_dir))
    state = jax.tree.map(np.array, state)  # writable copies
    state["params"]["embed"][0, 0] = np.nan
    ckpt = Checkpointer(nan / "checkpoints", keep=1, async_save=False)
    import orbax.checkpoint as ocp

    meta.pop("checksums")
    ckpt.manager.save(12, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    ckpt.close()
    for run, why in (
        (bad, r"could not be restored|do not match the checksums"),
        (nan, r"NaN/inf values in \['params'\]\['embed'\]"),
    ):
        for tool, args in (
            (evaluate.main, ["--checkpoint", str(run)]),
            (generate.main, ["--checkpoint", str(run), "--max_new_tokens", "2"]),
            (export.main, ["--checkpoint", str(run), "--out", str(tmp_path / "hf")]),
        ):
            assert tool(args) == 1
            err = capsys.readouterr().err
            assert re.search(why, err) and "--checkpoint DIR/STEP" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    # The intact run samples; a top-k larger than the vocabulary keeps every token instead of failing.
    assert generate.main(["--checkpoint", str(ref_dir), "--max_new_tokens", "2", "--top_k", "1000"]) == 0


def test_evaluate_falls_back_like_training(reference, tmp_path, capsys):
    """`evaluate` on a run whose newest step is damaged (its array files truncated) evaluates the newest
    intact step, saying in one line which step is damaged and which one it used, with no TensorStore
    or asyncio leftovers on stderr; a step whose `state/_METADATA` is gone is named so where training
    falls back (not as a pytree structure error)."""
    from boost_jax import evaluate

    ref_dir, make = reference
    run = tmp_path / "run"
    shutil.copytree(ref_dir / "checkpoints", run / "checkpoints")
    for f in (run / "checkpoints" / "12" / "state" / "d").iterdir():
        f.write_bytes(f.read_bytes()[:10])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "boost_jax.evaluate", "--checkpoint", str(run), "--batches", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: checkpoint {run / 'checkpoints'}/12 could not be restored")
    assert err[0].endswith(f"; using step 8, the newest intact checkpoint in {run / 'checkpoints'}"), err
    assert r.stdout.startswith(f"{run / 'checkpoints'}/8: eval loss"), r.stdout
    want = evaluate.evaluate(str(run / "checkpoints" / "8"), batches=1)
    assert f"eval loss {want['loss']:.4f}" in r.stdout
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["12", "4", "8"]  # nothing renamed
    # Its array files gone: TensorStore's error in one clean line (no spec JSON, no driver chain).
    for f in (run / "checkpoints" / "12" / "state" / "d").iterdir():
        f.unlink()
    capsys.readouterr()
    assert evaluate.main(["--checkpoint", str(run), "--batches", "1"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"warning: checkpoint {run / 'checkpoints'}/12 could not be restored (NOT_FOUND reading the array params."
    ), err
    assert "tensorstore_spec" not in err[0] and "driver" not in err[0] and "{" not in err[0], err
    for step in (4, 8):
        for f in (run / "checkpoints" / str(step) / "state" / "d").iterdir():
            f.write_bytes(f.read_bytes()[:10])
    capsys.readouterr()
    assert evaluate.main(["--checkpoint", str(run), "--batches", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"error: every checkpoint in {run / 'checkpoints'} is damaged (steps [4, 8, 12]; the newest: checkpoint"
    ), err
    shutil.rmtree(run / "checkpoints" / "4")
    shutil.copytree(ref_dir / "checkpoints" / "8", run / "checkpoints" / "8", dirs_exist_ok=True)

    (run / "checkpoints" / "12").rename(run / "12.truncated")
    shutil.copytree(ref_dir / "checkpoints" / "12", run / "checkpoints" / "12")
    (run / "checkpoints" / "12" / "state" / "_METADATA").unlink()
    capsys.readouterr()
    train.run(make(run))
    out = capsys.readouterr().out
    assert (
        f"warning: checkpoint {run / 'checkpoints'}/12 could not be restored (its state/_METADATA is missing)" in out
        and "pytree" not in out
    ), out
    assert "falling back to step 8, the newest intact checkpoint" in out


def test_disk_full_at_the_final_save_is_one_error_and_nothing_half_written(reference, tmp_path, monkeypatch, capsys):
    """The final save fails (disk full) and so does the metrics writer's flush: the save's own one-line
    error still comes, its partial files are removed, the step before stays the newest, and Orbax's
    tracebacks are not printed."""
    import logging

    ref_dir, make = reference
    from boost_jax.runtime.metrics import MetricsWriter

    def full_flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    disk_full_at(monkeypatch, 12)
    monkeypatch.setattr(MetricsWriter, "close", full_flush)
    cfg = make(tmp_path / "run", **{"checkpoint.async_save": True})
    with pytest.raises(
        CheckpointError,
        match=r"saving step 12 failed: No space left on device \[ENOSPC\] .* the last good checkpoint is step 8",
    ):
        train.run(cfg)
    out = capsys.readouterr()
    assert "note: closing the metrics writer failed (OSError" in out.out + out.err
    assert steps_on_disk(cfg.run_dir) == [4, 8] and tmp_dirs(cfg.run_dir) == []
    # Orbax's own ERROR records (its background threads log every failed save with a traceback) are
    # dropped where they pass; the one-line error above is the report.
    from absl import logging as absl_logging

    record = lambda path, level: logging.LogRecord("absl", level, path, 1, "save failed", None, None)  # noqa: E731
    handler = absl_logging.get_absl_handler()
    orbax_file = "/site-packages/orbax/checkpoint/_src/checkpoint_managers/async_checkpointer.py"
    assert not handler.filter(record(orbax_file, logging.ERROR))
    assert handler.filter(record(orbax_file, logging.WARNING)) and handler.filter(record(__file__, logging.ERROR))


def test_resume_false_on_a_run_dir_with_checkpoints(make_config, tmp_path):
    """checkpoint.resume=false never mixes two runs: refused, or with supersede the old steps move aside."""
    cfg = make_config(**{"run_dir": str(tmp_path / "run"), "train.stop_at_step": 4})
    train.run(cfg)
    again = make_config(**{"run_dir": str(tmp_path / "run"), "checkpoint.resume": False, "checkpoint.every": 2})
    with pytest.raises(ConfigError, match=r"checkpoint\.resume.*steps \[4\].*checkpoint\.supersede=true"):
        train.run(again)
    assert steps_on_disk(cfg.run_dir) == [4]
    again.checkpoint.supersede = True
    out = train.run(again)
    assert out["step"] == 8 and steps_on_disk(cfg.run_dir) == [4, 6, 8]  # the new run's own steps (keep 3)
    assert (Path(cfg.run_dir) / "checkpoints" / "4.superseded").is_dir()


# ---------------------------------------------------------------- data that changes under a run


def test_changed_data_under_a_resumed_run(make_config, tmp_path, capsys):
    """An edited text input: the resume stops naming it (the checkpoint's position refers to the old
    tokens), or with data.allow_changed continues, saying so in the log and in metrics.jsonl."""
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"def function_{i}(x):\n    return x * {i}\n\n" for i in range(3000)))
    cfg = make_config(
        **{"run_dir": str(tmp_path / "run"), "data.source": "text", "data.path": str(text), "train.stop_at_step": 4}
    )
    train.run(cfg)
    text.write_text(text.read_text().replace("return x", "return -x"))  # same files, other tokens
    cfg.train.stop_at_step = 0
    with pytest.raises(ConfigError, match=rf"data\.allow_changed.*changed since the checkpoint.*\({text}\)"):
        train.run(cfg)
    assert steps_on_disk(cfg.run_dir) == [4]
    cfg.data.allow_changed = True
    out = train.run(cfg)
    assert out["step"] == 8 and "note: the data changed since the checkpoint" in capsys.readouterr().out
    rows = [json.loads(line) for line in open(Path(cfg.run_dir) / "metrics.jsonl")]
    assert [r["step"] for r in rows if r.get("data_changed")] == [4]
    cfg.data.batching = "packed"  # the same data cut into other rows: the position means something else
    cfg.train.steps, cfg.data.allow_changed = 12, False
    with pytest.raises(ConfigError, match=r"data\.allow_changed.*\(data\.batching\)"):
        train.run(cfg)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_token_cache_is_rebuilt(make_config, tmp_path, capsys, damage):
    """A token cache damaged in place (same size) or truncated is found by its checksums and rebuilt:
    the run trains on the tokens of its inputs, not on the damage."""
    from boost_jax.data import build_loaders

    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox\n" for i in range(4000)))
    cfg = make_config(**{"run_dir": str(tmp_path / "run"), "data.source": "text", "data.path": str(text)})
    before = build_loaders(cfg)[0].batch(0)
    shard = next((Path(cfg.run_dir) / "token_cache").rglob("shard_00000.bin"))
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    else:
        shard.write_bytes(bytes(data[: len(data) // 2]))
    after = build_loaders(cfg)[0].batch(0)
    out = capsys.readouterr().out
    assert "token cache" in out and "is damaged" in out and "rebuilding it" in out, out
    np.testing.assert_array_equal(before, after)


def test_token_source_pointed_at_text(make_config, tmp_path):
    from boost_jax.data import build_loaders

    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n" * 100)
    with pytest.raises(ValueError, match=r"data\.path.*corpus\.txt is not a token file.*data\.source=text"):
        build_loaders(make_config(**{"data.source": "tokens", "data.path": str(text)}))


def test_an_update_that_would_overflow_a_weight_keeps_that_weight(make_config):
    """Finite loss and gradients with a step that overflows float32 for the largest gradients:
    those weights keep their values, every other weight takes its SGD step, the state stays finite.
    Reference: the one-device gradient (jax.grad of the same loss) and numpy's update."""
    import optax

    from boost_jax.runtime.build import build

    cfg = make_config(**{"parallel.num_devices": 1, "parallel.data": 1})
    probe = build(cfg, jax.devices()[:1], optimizer=(optax.sgd(1.0), lambda s: 1.0))
    state = probe.init_state()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (1, cfg.train.global_batch, cfg.train.seq_len + 1), np.int32)
    params = jax.device_get(state["params"])
    grads = jax.device_get(jax.grad(probe.loss_fn())(state["params"], jnp.asarray(tokens[0])))
    g = np.concatenate([np.abs(np.asarray(x, np.float64)).ravel() for x in jax.tree.leaves(grads)])
    # An SGD step of lr = a * b (each factor finite in float32, their product not) overflows the top 10%.
    a = np.float32(np.sqrt(3.0e38 / np.quantile(g[g > 0], 0.9)))
    # Injected (state, not constants): XLA may not fold the two factors into one, as it would constants.
    tx = optax.chain(
        optax.inject_hyperparams(optax.scale)(step_size=-float(a)),
        optax.inject_hyperparams(optax.scale)(step_size=float(a)),
    )
    built = build(cfg, jax.devices()[:1], optimizer=(tx, lambda s: 1.0))
    state = built.init_state()  # the same parameters (the config's seed), this optimizer's state
    assert all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(jax.device_get(state["params"])), jax.tree.leaves(params))
    )
    new, metrics = built.train_step(state, jax.device_put(tokens, built.batch_sharding))
    assert bool(metrics["finite"])
    kept = changed = 0
    top = float(np.finfo(np.float32).max)
    for got, p, d in zip(
        jax.tree.leaves(jax.device_get(new["params"])), jax.tree.leaves(params), jax.tree.leaves(grads)
    ):
        stepped = np.asarray(p, np.float64) - float(a) * float(a) * np.asarray(d, np.float64)
        assert np.isfinite(got).all()
        # Away from float32's edge (the step's gradient may differ from jax.grad's in the last bits):
        over, clear = np.abs(stepped) > 1.01 * top, np.abs(stepped) < 0.99 * top
        np.testing.assert_array_equal(got[over], np.asarray(p)[over])  # kept
        np.testing.assert_allclose(got[clear], stepped[clear], rtol=1e-2)  # stepped
        kept += int(over.sum())
        changed += int((clear & (d != 0)).sum())
    assert kept > 0 and changed > kept, (kept, changed)
