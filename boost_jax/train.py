"""Pre-train a model: `python -m boost_jax.train [--config configs/X.py] [--config.key=value ...]`.

Without flags it trains the tiny CoLA model on the embedded corpus on whatever devices JAX sees.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
from absl import logging as absl_logging
from tqdm import tqdm

from boost_jax import config as config_lib
from boost_jax.runtime import xla_gpu_flags
from boost_jax.runtime.checkpoint import Checkpointer, CheckpointError, resolve
from boost_jax.data import build_loaders
from boost_jax.runtime.distributed import DistributedError, maybe_initialize
from boost_jax.kernels.rmsnorm import kernels_used
from boost_jax.runtime.metrics import MetricsWriter, fmt_mfu, throughput
from boost_jax.model import flops_per_token
from boost_jax.runtime.optim import make_optimizer
from boost_jax.parallel.mesh import BATCH_AXES, make_mesh
from boost_jax.parallel.rules import use_rules
from boost_jax.parallel.strategies import get_strategy
from boost_jax.runtime.runlock import RunDirBusy, RunLock
from boost_jax.runtime.state import init_state, state_spec
from boost_jax.runtime.step import jit_train_step, make_eval_step
from jax.sharding import NamedSharding, PartitionSpec as P
from boost_jax.errors import TrainingDiverged

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.py"


def _agree(signal_name):
    """The signal any process received, or None; a collective, so all processes call it together."""
    from jax.experimental import multihost_utils
    got = multihost_utils.process_allgather(np.int32(signal_name is not None))
    return (signal_name or "SIGTERM") if np.any(got) else None


MAX_SKIPPED_IN_A_ROW = 20  # train.nonfinite=skip still stops when the run has clearly diverged


def _say(text: str) -> None:
    os.write(2, (text + "\n").encode())  # safe inside a signal handler (print is not reentrant)


class _StopFlag:
    """SIGTERM/SIGINT set a flag; the loop saves, waits for the save, and exits cleanly.

    The handlers stay installed until that save has committed: repeated signals (schedulers resend
    SIGTERM) are logged and absorbed. Only a third SIGINT (Ctrl-C) abandons the save, after saying
    which step a resume would start from."""

    def __init__(self):
        self.signal = None
        self.interrupts = 0
        self.committed = lambda: None  # the newest committed checkpoint's step (read at the moment)
        self.done = False  # the run's checkpoints are all written
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. called from a test runner thread)
                pass
        return self

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        self.interrupts += signum == signal.SIGINT
        if self.done:
            _say(f"{name}: the run has finished and its checkpoints are written; the process is exiting")
        elif self.signal is None:
            self.signal = name
            _say(f"{name}: stopping after this step with a checkpoint (further signals wait for it)")
        elif self.interrupts >= 3:
            safe = self.committed()  # read from disk now: an async save may have committed since the last step
            resume = ("from scratch" if safe is None else f"from step {safe}")
            _say(f"{name} a third time: exiting without finishing the checkpoint; a rerun resumes {resume} "
                 "and everything trained after it is lost")
            os._exit(130)
        else:
            _say(f"{name} again: still stopping; waiting for the checkpoint to be written"
                 + (" (a third SIGINT abandons it)" if signum == signal.SIGINT else ""))

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _batch_slice(mesh, global_batch: int) -> tuple[int, int]:
    """(index, count) of the slice of the global batch this process feeds. Processes whose devices
    hold the same rows (a tensor or pipeline axis spanning processes) must load the same rows."""
    shards = NamedSharding(mesh, P(BATCH_AXES)).addressable_devices_indices_map((global_batch,))
    lo = min(idx[0].start or 0 for idx in shards.values())
    hi = max(global_batch if idx[0].stop is None else idx[0].stop for idx in shards.values())
    return lo // (hi - lo), global_batch // (hi - lo)


def _to_global(batch: np.ndarray, sharding) -> jax.Array:
    return jax.make_array_from_process_local_data(sharding, batch)


def _open_run_dir(cfg, main_process: bool):
    """Create run_dir and take its lock (process 0 holds it for the whole run). One-line errors."""
    run_dir = Path(cfg.run_dir).expanduser().resolve()
    lock, busy = RunLock(run_dir), None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if main_process:
            lock.acquire()
    except RunDirBusy as e:
        busy = e
    except OSError as e:
        raise config_lib.ConfigError(f"config field `run_dir`: cannot write to {run_dir} "
                                     f"({e.strerror or e}); choose a writable directory") from e
    if jax.process_count() > 1:  # every process learns whether process 0 got the lock
        from jax.experimental import multihost_utils
        if not np.all(multihost_utils.process_allgather(np.int32(busy is None))):
            raise busy or RunDirBusy(f"config field `run_dir`: {run_dir} is in use (see process 0)")
    elif busy:
        raise busy
    return run_dir, lock


# Settings of one invocation, not of the run: changing them on resume is not worth a note.
PER_INVOCATION = ("restore_from", "train.stop_at_step", "train.progress", "distributed.", "compile_cache",
                  "profile_steps", "xla_gpu_flags")


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def _note_config_change(run_dir: Path, cfg, step: int) -> None:
    """Resuming with changed settings is allowed, but said aloud; the previous config.json is kept."""
    path = run_dir / "config.json"
    try:
        old = _flat(json.loads(path.read_text()))
    except (OSError, ValueError):
        return
    new = _flat(json.loads(cfg.to_json_best_effort()))
    changed = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in new.items()
               if old.get(k) != v and not k.startswith(PER_INVOCATION)]
    if changed:
        keep = path.with_name(f"config.before_step{step}.json")
        path.rename(keep)
        print(f"note: resuming with a changed config ({'; '.join(changed[:6])}{' ...' if len(changed) > 6 else ''}); "
              f"the previous config.json is kept as {keep.name}")


def _num(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def run(cfg, stop: _StopFlag | None = None) -> dict:
    """Train per `cfg`; returns a summary (first/last eval loss, where things were written).

    SIGTERM/SIGINT are handled while it runs; the command line passes its own `stop`, installed for
    the whole process, so that signals arriving after the final save are absorbed too."""
    config_lib.validate(cfg)
    gpu_flags, _ = xla_gpu_flags.apply() if cfg.xla_gpu_flags else ([], "")  # before JAX starts its backends
    maybe_initialize(cfg)  # before anything below asks JAX for devices (process_index does)
    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every save step at INFO
    main_process = jax.process_index() == 0
    say = print if main_process else (lambda *a, **k: None)
    if gpu_flags:
        say(f"XLA_FLAGS: added {len(gpu_flags)} GPU flags (boost_jax/runtime/xla_gpu_flags.py; xla_gpu_flags=false "
            "leaves XLA_FLAGS alone)")
    _use_compile_cache(cfg.compile_cache)
    with contextlib.nullcontext(stop) if stop is not None else _StopFlag() as stop:
        run_dir, lock = _open_run_dir(cfg, main_process)
        try:
            return _train(cfg, run_dir, stop, say)
        finally:
            lock.release()


def _use_compile_cache(directory: str) -> None:
    """Point JAX's persistent compilation cache at `directory` (created if missing); "" leaves it."""
    if not directory:
        return
    from jax.experimental.compilation_cache import compilation_cache as cc
    path = Path(directory).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise config_lib.ConfigError(f"config field `compile_cache`: cannot create {path} ({e.strerror or e}); "
                                     "choose a writable directory or \"\" for no cache") from e
    if jax.config.jax_compilation_cache_dir != str(path):
        cc.set_cache_dir(str(path))
        cc.reset_cache()  # JAX decides once whether to use a cache: ask again with the new directory


class _Profiler:
    """A jax.profiler trace of train steps [first, last] (1-based) into `directory`."""

    def __init__(self, steps: str, directory: str, say):
        self.range, self.directory, self.say, self.active = config_lib.profile_range(steps), directory, say, False

    def before(self, step: int) -> None:  # step: the number of the step about to run
        if self.range and not self.active and self.range[0] <= step <= self.range[1]:
            jax.profiler.start_trace(self.directory)
            self.active = True

    def after(self, step: int, state) -> None:  # step: the number of the step that just ran
        if self.active and step >= self.range[1]:
            self.stop(state, step)

    def stop(self, state, step: int) -> None:
        if self.active:
            jax.block_until_ready(state)  # the traced steps' device work belongs in the trace
            jax.profiler.stop_trace()
            self.active = False
            self.say(f"profile of steps {self.range[0]}..{step} written to {self.directory} "
                     f"(tensorboard --logdir {self.directory}, profile tab)")


def _train(cfg, run_dir: Path, stop: _StopFlag, say) -> dict:
    t, main_process = cfg.train, jax.process_index() == 0
    mesh = make_mesh(cfg)
    strategy = get_strategy(cfg.parallel)
    train_data, eval_data, _ = build_loaders(cfg, *_batch_slice(mesh, t.global_batch))
    tx, schedule = make_optimizer(t)
    fpt = flops_per_token(cfg.model, t.seq_len)
    tokens_per_step = t.global_batch * t.seq_len
    device_kind = jax.devices()[0].device_kind

    with use_rules(mesh, strategy):
        spec = state_spec(cfg, tx, mesh, strategy)
        # This process group holds run_dir's lock: the checkpointer may clean up unfinished saves.
        ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save,
                            owner=True)
        state, meta, step = None, None, None
        if cfg.restore_from:
            root, step = resolve(cfg.restore_from)
            source = Checkpointer(root, keep=cfg.checkpoint.keep, create=False)
            if step is None:
                if not source.all_steps():
                    raise CheckpointError(f"config field `restore_from`: no checkpoint in {root}")
                state, meta, step = source.restore_newest_good(spec.abstract, log=say)
            else:
                state, meta = source.restore(step, spec.abstract)
            source.close()
            ckpt.move_newer_aside(step, log=say)  # their labels would collide with the new ones
        elif cfg.checkpoint.resume and ckpt.all_steps():
            source = ckpt
            state, meta, step = ckpt.restore_newest_good(spec.abstract, log=say)
        if state is not None:
            position = int(meta["data_position"])
            say(f"restored step {step} from {source.directory} (data position {position})")
            if main_process:
                _note_config_change(run_dir, cfg, step)
        else:
            state, position = init_state(cfg, tx, spec), 0
        skipped = int((meta or {}).get("skipped_steps", 0))

        train_step, batch_sharding = jit_train_step(spec, tx, schedule, mesh)
        eval_sharding = NamedSharding(mesh, P(BATCH_AXES))
        eval_step = jax.jit(make_eval_step(spec.graphdef, t.eval_microbatches or t.grad_accum),
                            in_shardings=(spec.shardings["params"], eval_sharding))

        def evaluate(params) -> float:
            losses = [eval_step(params, _to_global(eval_data.batch(i * t.global_batch), eval_sharding))
                      for i in range(t.eval_batches)]
            return float(np.mean(jax.device_get(losses)))

        def meta_for(step: int) -> dict:
            return {"data_position": position, "step": step, "skipped_steps": skipped,
                    "config": json.loads(cfg.to_json_best_effort())}

        writer = MetricsWriter(str(run_dir), enabled=main_process)
        if main_process:
            (run_dir / "config.json").write_text(cfg.to_json_best_effort(indent=2))
        step = int(jax.device_get(state["step"]))
        stop.committed = ckpt.committed_step
        evals: list[tuple[int, float]] = []
        if step < t.steps:
            evals.append((step, evaluate(state["params"])))
            writer.write(step, {"eval_loss": evals[-1][1]})
        bar = tqdm(total=t.steps, initial=step, disable=not (main_process and t.progress), dynamic_ncols=True,
                   desc=cfg.name, unit="step")
        window_start, window_steps, last_saved, stopped = time.perf_counter(), 0, step, None
        first_step = step
        kernels_used()  # start the record afresh: the first train step below traces the model
        profiler = _Profiler(cfg.profile_steps, str(run_dir / "tensorboard"), bar.write if main_process else say)
        unchecked = []  # (step, metrics) not yet read back: checked together at the next log or save
        in_a_row = 0  # non-finite steps in a row
        end = min(t.stop_at_step or t.steps, t.steps)
        try:
            while step < end:
                ckpt.check()  # a background save that failed stops the run here, not at the next save
                local = train_data.batch(position).reshape(t.grad_accum, -1, t.seq_len + 1)
                profiler.before(step + 1)
                with jax.profiler.StepTraceAnnotation("train", step_num=step + 1):
                    state, metrics = train_step(state, _to_global(local, batch_sharding))
                profiler.after(step + 1, state)
                if step == first_step:  # traced now: record what the kernels actually ran
                    writer.write(step + 1, {"kernels": kernels_used()})
                position += t.global_batch
                step += 1
                window_steps += 1
                unchecked.append((step, metrics))
                bar.update(1)
                signalled = stop.signal  # read once: a signal arriving later is handled next step
                due_log = step % t.log_every == 0 or step == end
                if jax.process_count() > 1:  # every process must stop (and save) at the same step
                    signalled = _agree(signalled) if due_log else None
                due_save = step % cfg.checkpoint.every == 0 or step == end or signalled
                if due_log or due_save:
                    seen, unchecked = jax.device_get(unchecked), []
                    m = seen[-1][1]
                    for bad, bm in seen:
                        if bm["finite"]:
                            in_a_row = 0
                            continue
                        what = f"loss {bm['loss']}, grad norm {bm['grad_norm']} or the updated weights not finite"
                        in_a_row += 1
                        if t.nonfinite == "skip" and in_a_row < MAX_SKIPPED_IN_A_ROW:
                            skipped += 1
                            if main_process:
                                bar.write(f"step {bad}: {what}; skipped it (train.nonfinite=skip)")
                            continue
                        if in_a_row > 1:
                            what += f" ({in_a_row} steps in a row)"
                        ckpt.wait()
                        last = ckpt.committed_step()
                        raise TrainingDiverged(
                            f"step {bad}: {what}; stopping (train.nonfinite={t.nonfinite}). "
                            + (f"The last good checkpoint is step {last} in {ckpt.directory}"
                               if last is not None else "No checkpoint was saved yet")
                            + "; lower train.lr or raise train.warmup_steps"
                            + (", or set train.nonfinite=skip to skip such steps" if t.nonfinite == "stop" else ""))
                if due_log:
                    elapsed = time.perf_counter() - window_start
                    rate = throughput(tokens_per_step * window_steps, elapsed, fpt, jax.device_count(), device_kind)
                    loss = _num(m["loss"]) if m["finite"] else None
                    record = {"loss": loss, "perplexity": None if loss is None else math.exp(min(loss, 50.0)),
                              "grad_norm": _num(m["grad_norm"]), "lr": float(m["lr"]), "skipped_steps": skipped,
                              "step_time_s": elapsed / window_steps, **rate, **train_data.source_tokens(position)}
                    writer.write(step, record)
                    bar.set_postfix(loss="skipped" if loss is None else f"{loss:.3f}",
                                    tok_s=f"{rate['tokens_per_s']:.0f}", mfu=fmt_mfu(rate["mfu"]))
                    window_start, window_steps = time.perf_counter(), 0
                if t.eval_every and (step % t.eval_every == 0 or step == end):
                    evals.append((step, evaluate(state["params"])))
                    writer.write(step, {"eval_loss": evals[-1][1]})
                    bar.write(f"step {step}: eval loss {evals[-1][1]:.4f}") if main_process else None
                if due_save:
                    ckpt.save(step, state, meta_for(step), force=True)  # first waits for the previous save
                    last_saved = step
                if signalled:
                    stopped = signalled
                    break
        finally:
            profiler.stop(state, step)  # a run that ends (or fails) inside the traced steps keeps its trace
            bar.close()
            writer.close()
            ckpt.close()  # waits for any async save in flight (signals wait too): a started save is finished
            stop.done = True
    summary = {"run_dir": str(run_dir), "checkpoints": str(ckpt.directory), "last_checkpoint_step": last_saved,
               "metrics": writer.path, "tensorboard": writer.tb_dir, "step": step, "evals": evals,
               "stopped_by": stopped, "skipped_steps": skipped}
    if main_process:
        if evals:
            print(f"eval loss: first {evals[0][1]:.4f} (step {evals[0][0]}) -> last {evals[-1][1]:.4f} "
                  f"(step {evals[-1][0]})")
        if skipped:
            print(f"{skipped} step(s) were skipped as not finite (train.nonfinite=skip)")
        if stopped:
            print(f"stopped by {stopped} at step {step}; checkpoint saved")
        print(f"run dir:      {run_dir}\ncheckpoints:  {ckpt.directory} (last step {last_saved})\n"
              f"metrics:      {writer.path}\ntensorboard:  tensorboard --logdir {writer.tb_dir}")
    return summary


def _flag_error(e: Exception, argv) -> None:
    """A misspelt --config.KEY or a missing --config file as a one-line error, not a traceback."""
    why = e
    while isinstance(why, (AttributeError, KeyError)) and why.args:  # unwrap to ml_collections' text
        why = why.args[0]
    why = str(why).replace("\n", "; ")
    if isinstance(e, OSError):
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip().startswith("[Errno")]
        print(f"error: --config: {lines[0] if lines else why}", file=sys.stderr)
    else:
        print(f"error: {' '.join(argv[1:])}: unknown key {why} (the keys are those of boost_jax/config.py)",
              file=sys.stderr)
    sys.exit(1)


def main(argv=None) -> int:
    from absl import app, flags
    from ml_collections import config_flags

    argv = sys.argv if argv is None else argv
    flags_ = flags.FLAGS
    try:  # the config file is loaded and the overrides resolved already here and in parsing
        config_flags.DEFINE_config_file("config", str(DEFAULT_CONFIG), "Run config file (configs/*.py)",
                                        lock_config=True, sys_argv=argv)
    except (AttributeError, KeyError, OSError) as e:
        _flag_error(e, argv)

    def parse(args):
        try:
            return app.parse_flags_with_usage(args)
        except (AttributeError, KeyError, OSError) as e:
            _flag_error(e, args)

    stop = _StopFlag()

    def _main(_):
        try:
            cfg = flags_.config
            cfg.name  # noqa: B018 - a config file that failed to load raises on first use
        except OSError as e:
            _flag_error(e, argv)
        try:
            run(cfg, stop.__enter__())  # never uninstalled: a signal after the final save is absorbed too
        except (config_lib.ConfigError, CheckpointError, TrainingDiverged, DistributedError, RunDirBusy,
                FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)

    app.run(_main, argv=argv, flags_parser=parse)
    return 0


if __name__ == "__main__":
    main()
