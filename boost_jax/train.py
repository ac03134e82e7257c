"""Pre-train a model: `python -m boost_jax.train [--config configs/X.py] [--config.key=value ...]`.

Without flags it trains the tiny CoLA model on the embedded corpus on whatever devices JAX sees.
Read top-down: `run` (set-up), `_train` (build, restore, loop, finish), then the loop's parts.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from pathlib import Path

import jax
from absl import logging as absl_logging
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax import xla_gpu_flags
from boost_jax.data import build_loaders
from boost_jax.data.mapped import check_sizes, mapped_since, mark
from boost_jax.errors import (
    CheckpointError,
    ConfigError,
    DistributedError,
    RunDirBusy,  # noqa: F401 - re-exported
    TrainingDiverged,
    error_lines,
)
from boost_jax.kernels.rmsnorm import kernels_used
from boost_jax.model import autos, flops_per_token
from boost_jax.model.kinds import kind_class
from boost_jax.parallel.mesh import BATCH_AXES
from boost_jax.runtime.build import build, to_global
from boost_jax.runtime.checkpoint import Checkpointer, cannot_write, restore
from boost_jax.runtime.distributed import maybe_initialize
from boost_jax.runtime.evaluation import EvalInterrupted, eval_loss, plan_eval
from boost_jax.runtime.report import Profiler, Reporter
from boost_jax.runtime.runlock import note_config_change, open_run_dir
from boost_jax.runtime.signals import STOP_SIGNALS, StopFlag, agree
from boost_jax.validate import validate

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "tiny.py"  # packaged (a checkout: configs/)
PREDICTION_WINDOWS = 3  # parallel.plan=auto: logged step times compared with the planner's prediction
MAX_SKIPPED_IN_A_ROW = 20  # train.nonfinite=skip still stops when the run has clearly diverged
ERRORS = (ConfigError, CheckpointError, TrainingDiverged, DistributedError, RunDirBusy, FileNotFoundError, ValueError)


def run(cfg, stop: StopFlag | None = None, config_file: str = "") -> dict:
    """Train per `cfg`; returns a summary (first/last eval loss, where things were written).

    SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 stop it with a checkpoint while it runs; the command
    line passes its own `stop`, installed for the whole process, so that signals arriving after the
    final save are absorbed too. `config_file`: where cfg came from, for the start-up line."""
    validate(cfg)
    gpu_flags, _ = xla_gpu_flags.apply() if cfg.xla_gpu_flags else ([], "")  # before JAX starts its backends
    maybe_initialize(cfg)  # before anything below asks JAX for devices (process_index does)
    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every save step at INFO
    main_process = jax.process_index() == 0
    say = print if main_process else (lambda *a, **k: None)
    if gpu_flags:
        say(
            f"XLA_FLAGS: added {len(gpu_flags)} GPU flags (boost_jax/xla_gpu_flags.py; xla_gpu_flags=false "
            "leaves XLA_FLAGS alone)"
        )
    planned = None
    if cfg.parallel.plan == "auto":
        cfg, planned = _auto_plan(cfg, say)
    _use_compile_cache(cfg.compile_cache)
    with contextlib.nullcontext(stop) if stop is not None else StopFlag() as stop:
        run_dir, lock = open_run_dir(cfg, main_process)
        try:
            return _train(cfg, run_dir, stop, say, config_file, planned)
        except OSError as e:  # a full disk or a read-only mount under run_dir: one line, not a traceback
            failure = cannot_write(e, run_dir / "checkpoints")
            if failure is None:
                raise
            raise failure from e
        finally:
            lock.release()


def _auto_plan(cfg, say):
    """parallel.plan=auto: the config of the planner's best runnable plan for the devices this run
    uses (boost_jax/planner/auto.py), validated, and the plan; its pick printed in one line."""
    from boost_jax.parallel.mesh import mesh_devices
    from boost_jax.planner.auto import plan_run

    devices = mesh_devices(cfg.parallel)
    cfg, planned = plan_run(cfg, len(devices), devices[0].device_kind)
    say(planned.describe())
    say(f"  (explicitly: {planned.plan.overrides})")
    return validate(cfg), planned


def _train(cfg, run_dir: Path, stop: StopFlag, say, config_file: str = "", planned=None) -> dict:
    main_process = jax.process_index() == 0
    built = build(cfg, validated=True)  # `run` validated it before JAX started
    say(_startup_line(cfg, built, config_file, planned))
    # The data, and what they make of the config (the eval split's size), before anything compiles.
    train_data, eval_data = _load_data(cfg, built, cfg.data.shuffle)
    reading = _eval_plan(cfg, eval_data, say)
    # This process group holds run_dir's lock: the checkpointer may clean up unfinished saves.
    ckpt = Checkpointer(
        run_dir / "checkpoints", keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save, owner=True
    )
    state, position, skipped, meta = _restore_or_init(cfg, built, ckpt, run_dir, say)
    order = _data_order(cfg, meta, say)
    if order != cfg.data.shuffle:  # the checkpoint's position refers to another permutation of the samples
        train_data, eval_data = _load_data(cfg, built, order)
    changed = _check_data(cfg, meta, train_data, say)
    if main_process:
        (run_dir / "config.json").write_text(cfg.to_json_best_effort(indent=2))
    step = int(jax.device_get(state["step"]))
    report = Reporter(
        cfg, run_dir, main_process=main_process, flops_per_token=flops_per_token(cfg.model, cfg.train.seq_len)
    )
    if planned is not None:  # what parallel.plan=auto ran, and what the planner predicted for it
        report.write(
            step,
            {
                "plan": "auto",
                "plan_overrides": planned.plan.overrides,
                "plan_cluster": planned.cluster_file,
                "planner_step_time_s": planned.plan.step_s,
                "planner_memory_gb": planned.plan.memory["total"] / 1e9,
            },
        )
    evaluate = _evaluator(built, eval_data, reading)
    stop.committed = ckpt.committed_step
    end = min(cfg.train.stop_at_step or cfg.train.steps, cfg.train.steps)
    if step >= end:
        say(_complete_line(cfg, step, ckpt))
    else:
        say(
            "compiling the train and eval steps (the first step waits for it; --config.compile_cache=DIR "
            "keeps them for the next start)"
        )
    if step < end and cfg.train.eval_every:  # eval_every=0: no evaluation at all
        try:
            report.eval(step, evaluate(state["params"], stop=lambda: _stop_requested(stop)), say=False)
        except EvalInterrupted:  # the loop's first step sees the signal: it saves and stops there
            say(f"{stop.signal or 'a signal'}: the evaluation at step {step} was stopped between batches")
    elif cfg.train.eval_every and _final_eval_cut(meta, run_dir, step):
        say(f"the final evaluation (step {step}) was stopped before it finished when the run ended; running it now")
        try:
            result = evaluate(state["params"], stop=lambda: _stop_requested(stop))
            report.eval(step, result, say=False)
            say(f"step {step}: eval loss {result['loss']:.4f} (CoLA's reported form {result['cola_loss']:.4f})")
        except EvalInterrupted:  # nothing to save: the checkpoint still says that this evaluation is due
            report.write(step, {"eval_stopped": 1})
            say(f"{stop.signal or 'a signal'}: the final evaluation was stopped again; a rerun runs it")
    loop = _Loop(
        cfg,
        built,
        ckpt,
        report,
        stop,
        train_data,
        evaluate,
        position,
        skipped,
        run_dir,
        order=order,
        tokens_seen=int(meta.get("tokens_seen", position * cfg.train.seq_len)),
        predicted_s=planned.plan.step_s if planned is not None else None,
    )
    if changed:
        report.write(step, {"data_changed": 1, "data_changed_sources": ", ".join(changed)})
    try:
        state, step = loop.run(state, step)
    finally:
        _close(loop, report, ckpt, say)
        stop.done = True
    return _finish(run_dir, ckpt, report, loop, step, main_process)


def _startup_line(cfg, built, config_file: str, planned=None) -> str:
    """One line: the model, its parameters, the devices and mesh, the strategy, the batching, the config."""
    import math

    params = sum(
        math.prod(x.shape)
        for x in jax.tree.leaves(built.spec.abstract["params"])
        if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
    )
    m, t, p = cfg.model, cfg.train, cfg.parallel
    mesh = "x".join(f"{k} {v}" for k, v in built.mesh.shape.items() if v > 1) or "one device"
    devices = built.mesh.devices.size
    picks = autos.chosen(cfg, built.mesh)
    auto = f" (auto: {autos.describe(picks)})" if picks else ""
    return (
        f"{cfg.name}: {m.linear} model, {params / 1e6:.2f}M parameters (d {m.d_model}, {m.n_layers} layers"
        f"{f', rank {m.rank}' if kind_class(m.linear).factored else ''}); {devices} {jax.default_backend()} device"
        f"{'s' if devices > 1 else ''}, mesh {mesh}{' (parallel.plan=auto)' if planned else ''}, strategy "
        f"{p.strategy}{auto}; batch {t.global_batch} x "
        f"{t.seq_len} ({cfg.data.batching}, grad_accum {t.grad_accum}), {t.steps} steps; config "
        f"{config_file or 'given as a ConfigDict'}"
    )


def _complete_line(cfg, step: int, ckpt: Checkpointer) -> str:
    """What a rerun of a run that already reached its last (or its stop_at_step) step says."""
    t = cfg.train
    if step >= t.steps:
        return (
            f"the run is complete: step {step} of {t.steps} is saved in {ckpt.directory}; nothing to train "
            "(raise --config.train.steps to train on, or choose a new --config.run_dir)"
        )
    return (
        f"the run is at step {step}, at or past --config.train.stop_at_step={t.stop_at_step} (of "
        f"{t.steps}); nothing to train (raise or drop train.stop_at_step to continue)"
    )


def _close(loop, report: Reporter, ckpt: Checkpointer, say) -> None:
    """The exit path, each part guarded on its own: the profiler trace, the metrics writer (a full
    disk can fail its flush) and the checkpointer, which waits for the save in flight and, if that
    save failed, removes its partial files and raises its one-line error (which wins)."""
    for what, close in (
        ("the profiler trace", lambda: loop.profiler.stop(loop.state, loop.step)),
        ("the metrics writer", report.close),
    ):
        try:
            close()
        except Exception as e:  # noqa: BLE001 - reported, never allowed to skip the checkpoint's own close
            say(f"note: closing {what} failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    ckpt.close()  # waits for any async save in flight (signals wait too): a started save is finished


def _restore_or_init(cfg, built, ckpt: Checkpointer, run_dir: Path, say) -> tuple[dict, int, int, dict]:
    """(state, data position, skipped steps, the checkpoint's metadata or {}): restored from
    `restore_from`, else resumed from the run's own newest good checkpoint, else freshly initialised."""
    restored = None
    if cfg.restore_from:
        restored = restore(cfg.restore_from, built.spec.abstract, log=say)
        ckpt.move_newer_aside(restored.step, log=say)  # their labels would collide with the new ones
    elif cfg.checkpoint.resume and ckpt.all_steps():
        restored = restore(ckpt, built.spec.abstract, log=say)
    elif ckpt.all_steps():  # resume=false on a run_dir with checkpoints: never mix two runs' steps
        if not cfg.checkpoint.supersede:
            raise ConfigError(
                f"config field `checkpoint.resume`: false, but {ckpt.directory} holds checkpoints "
                f"(steps {ckpt.all_steps()}) that a new run would mix with; choose a new run_dir, "
                "or set checkpoint.supersede=true to move them aside as N.superseded"
            )
        ckpt.move_newer_aside(None, log=say)
    if restored is None:
        return built.init_state(), 0, 0, {}
    position = int(restored.meta["data_position"])
    say(f"restored step {restored.step} from {restored.directory} (data position {position})")
    if jax.process_index() == 0:
        note_config_change(run_dir, cfg, restored.step)
    return restored.state, position, int(restored.meta.get("skipped_steps", 0)), restored.meta


def _data_order(cfg, meta: dict, say) -> str:
    """The permutation that orders the train data: data.shuffle, or for a resumed run the one its
    checkpoint's position refers to (checkpoints written before data.shuffle existed: numpy)."""
    if not meta:
        return cfg.data.shuffle
    used = meta.get("data_shuffle", "numpy")
    if used != cfg.data.shuffle:
        say(
            f"note: the checkpoint's data position was reached with data.shuffle={used}; continuing with it "
            f"(data.shuffle={cfg.data.shuffle} applies to new runs)"
        )
    return used


def _check_data(cfg, meta: dict, data, say) -> list[str]:
    """A resumed run's data must be what its checkpoint's position refers to (data.allow_changed=true
    continues on changed data, saying so); returns what changed."""
    from boost_jax.data import changed_sources

    recorded = meta.get("data_identity")
    if not recorded:  # a fresh run, or a checkpoint written before data identities were recorded
        return []
    changed = changed_sources(recorded, data.identity)
    if changed and not cfg.data.allow_changed:
        raise ConfigError(
            f"config field `data.allow_changed`: the data changed since the checkpoint was written "
            f"({', '.join(changed)}), so its data position (sample {meta['data_position']:,}) would "
            "read other batches; restore the data it trained on, or set data.allow_changed=true to "
            "continue on the new data from that position"
        )
    if changed:
        say(
            f"note: the data changed since the checkpoint ({', '.join(changed)}); continuing on the new data "
            "from the same position (data.allow_changed=true)"
        )
    return changed


def _load_data(cfg, built, order: str):
    """(train loader, eval loader) of this process's rows, the train samples in `order`; the train
    loader records the token files it maps (checked at log and save points)."""
    before = mark()
    train_data, eval_data, _ = build_loaders(cfg, *_batch_slice(built.mesh, cfg.train.global_batch), order=order)
    train_data.mapped = mapped_since(before)  # the token files this run reads, with their sizes
    return train_data, eval_data


def _eval_plan(cfg, eval_data, say):
    """What each evaluation reads (runtime/evaluation.py plan_eval), settled at start-up: a token
    budget the held-out split cannot meet is a ConfigError now, not after compiling; a split smaller
    than train.eval_batches batches is read whole, once, and said so here. None: no evaluation."""
    if not cfg.train.eval_every:
        return None
    reading = plan_eval(cfg, eval_data)
    if reading.note:
        say(reading.note)
    return reading


def _final_eval_cut(meta: dict, run_dir: Path, step: int) -> bool:
    """Whether the checkpoint a finished run resumed from says that its step's evaluation was stopped
    (a signal during the final evaluation) and no later start ran it (metrics.jsonl: an eval_loss row
    of that step after its last eval_stopped row). Every process gets process 0's answer."""
    if not meta.get("eval_stopped"):
        return False
    cut = True
    if jax.process_index() == 0:
        try:
            with open(run_dir / "metrics.jsonl") as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if row.get("step") == step and ("eval_loss" in row or "eval_stopped" in row):
                        cut = "eval_stopped" in row
        except OSError:
            pass
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        cut = bool(multihost_utils.broadcast_one_to_all(np.int32(cut)))
    return cut


def _evaluator(built, eval_data, reading):
    """params -> eval result (runtime/evaluation.py): the loss per target token over train.eval_batches
    global batches of the held-out split (all of a smaller split, once), or with train.eval_tokens
    over batches as CoLA reads them; and CoLA's reported form beside it (`cola_loss`)."""
    return lambda params, stop=None: eval_loss(built, eval_data, params, stop=stop, plan=reading)


def _stop_requested(stop: StopFlag) -> bool:
    """Whether a stop signal came (to any process: then all agree, a collective)."""
    return (agree(stop.signal) if jax.process_count() > 1 else stop.signal) is not None


class _Loop:
    """The training loop: a step per batch; at each log or save point the health checks (non-finite
    steps, signals), the report, evaluation and the checkpoint."""

    def __init__(
        self,
        cfg,
        built,
        ckpt,
        report,
        stop,
        train_data,
        evaluate,
        position: int,
        skipped: int,
        run_dir: Path,
        *,
        order: str,
        tokens_seen: int,
        predicted_s: float | None = None,
    ):
        self.cfg, self.built, self.ckpt, self.report, self.stop = cfg, built, ckpt, report, stop
        self.data, self.evaluate, self.position, self.skipped = train_data, evaluate, position, skipped
        self.order, self.tokens_seen = order, tokens_seen  # the data order; input tokens that were not padding
        self.unchecked = []  # (step, metrics) not yet read back: checked together at the next log or save
        self.in_a_row = 0  # non-finite steps in a row
        self.last_saved, self.stopped = None, None
        self.eval_stopped = None  # the step whose evaluation a signal stopped
        self.profiler = Profiler(cfg.profile_steps, str(run_dir / "tensorboard"), report.note)
        self.mapped = getattr(train_data, "mapped", {})  # {token file: its size}, checked at log and save points
        self.state, self.step = None, 0  # the newest state and its step (the exit path reads them)
        # parallel.plan=auto: the planner's step time, set beside the first PREDICTION_WINDOWS logged ones
        self.predicted_s, self.windows = predicted_s, 0

    def run(self, state, step: int) -> tuple[dict, int]:
        t = self.cfg.train
        end, first = min(t.stop_at_step or t.steps, t.steps), step
        self.last_saved = step
        self.state, self.step = state, step
        if step >= end:  # nothing to train (said at the start): no progress bar
            return state, step
        self.report.start_bar(step)
        kernels_used()  # start the record afresh: the first train step below traces the model
        while step < end:
            self.ckpt.check()  # a background save that failed stops the run here, not at the next save
            local = jax.tree.map(lambda x: x.reshape(t.grad_accum, -1, *x.shape[1:]), self.data.batch(self.position))
            self.profiler.before(step + 1)
            with jax.profiler.StepTraceAnnotation("train", step_num=step + 1):
                self.state, metrics = self.built.train_step(self.state, to_global(local, self.built.batch_sharding))
            self.profiler.after(step + 1, self.state)
            if step == first:  # traced now: record what the kernels actually ran
                self.report.write(step + 1, {"kernels": kernels_used()})
            self.position += t.global_batch
            step += 1
            self.step = step
            self.unchecked.append((step, metrics))
            self.report.step_done()
            if self._after_step(step, end):
                break
        return self.state, step

    def _after_step(self, step: int, end: int) -> bool:
        """Logging, evaluation and saving after `step`; True when a signal stops the run here."""
        t = self.cfg.train
        signalled = self.stop.signal  # read once: a signal arriving later is handled next step
        due_log = step % t.log_every == 0 or step == end
        if jax.process_count() > 1:  # every process must stop (and save) at the same step
            signalled = agree(signalled) if due_log else None
        due_save = step % self.cfg.checkpoint.every == 0 or step == end or signalled
        if due_log or due_save:
            if jax.process_count() == 1:  # (several processes might see a truncation at different steps)
                check_sizes(self.mapped)  # a token file shrunk under the run: stop cleanly before a read faults
            seen, self.unchecked = jax.device_get(self.unchecked), []
            self._check_finite(seen)
            self._count_tokens(seen)
            if due_log:
                record = self.report.log(
                    step,
                    seen[-1][1],
                    self.skipped,
                    {"tokens_seen": self.tokens_seen, **self.data.source_tokens(self.position)},
                )
                self._against_prediction(step, record["step_time_s"])
        if t.eval_every and (step % t.eval_every == 0 or step == end):
            try:
                self.report.eval(step, self.evaluate(self.state["params"], stop=lambda: _stop_requested(self.stop)))
            except EvalInterrupted:  # a signal during a long evaluation: save and stop now, not after it
                signalled = self.stop.signal or "SIGTERM"  # (another process's, when this one got none)
                self.eval_stopped = step  # its checkpoint says so: a start from it evaluates this step
                self.report.write(step, {"eval_stopped": 1})
                self.report.note(
                    f"{signalled}: the evaluation at step {step} was stopped between batches "
                    "(not reported; a rerun evaluates this step); saving"
                )
                if not (due_log or due_save):
                    seen, self.unchecked = jax.device_get(self.unchecked), []
                    self._check_finite(seen)
                    self._count_tokens(seen)
                due_save = True
        if due_save:
            self.ckpt.save(step, self.state, self._meta(step), force=True)  # first waits for the previous save
            self.last_saved = step
        if signalled:
            self.stopped = signalled
        return bool(signalled)

    def _against_prediction(self, step: int, measured_s: float) -> None:
        """parallel.plan=auto: the first PREDICTION_WINDOWS logged step times beside the planner's
        (the first window includes compiling the step), in the output and metrics.jsonl."""
        if self.predicted_s is None or self.windows >= PREDICTION_WINDOWS:
            return
        self.windows += 1
        ratio = measured_s / self.predicted_s
        self.report.write(step, {"planner_step_time_s": self.predicted_s, "measured_over_planner": ratio})
        self.report.note(
            f"step {step}: {measured_s:.3g} s per step, {ratio:.3g}x the planner's {self.predicted_s:.3g} s"
            + (" (this window includes compiling the step)" if self.windows == 1 else "")
        )

    def _count_tokens(self, seen) -> None:
        """Input tokens that are not padding (all of them in stream batches), for tokens/s, MFU and
        tokens_seen."""
        t = self.cfg.train
        for _, m in seen:
            n = int(m["tokens"]) if "tokens" in m else t.global_batch * t.seq_len
            self.tokens_seen += n
            self.report.count_tokens(n)

    def _check_finite(self, seen) -> None:
        """train.nonfinite: skip non-finite steps (never applied) or stop, naming the last good checkpoint."""
        t = self.cfg.train
        for bad, m in seen:
            if m["finite"]:
                self.in_a_row = 0
                continue
            what = f"loss {m['loss']}, grad norm {m['grad_norm']} or the updated weights not finite"
            self.in_a_row += 1
            if t.nonfinite == "skip" and self.in_a_row < MAX_SKIPPED_IN_A_ROW:
                self.skipped += 1
                self.report.note(f"step {bad}: {what}; skipped it (train.nonfinite=skip)")
                continue
            if self.in_a_row > 1:
                what += f" ({self.in_a_row} steps in a row)"
            self.ckpt.wait()
            # The state saved after step `source` computed the first non-finite step of this run of them:
            # that checkpoint (and any later one) is set aside as N.diverged, never deleted.
            source = bad - self.in_a_row
            self.ckpt.move_newer_aside(
                source - 1,
                log=self.report.note,
                suffix="diverged",
                why=f"its state gave the non-finite step {source + 1}",
            )
            last = self.ckpt.committed_step()
            raise TrainingDiverged(
                f"step {bad}: {what}; stopping (train.nonfinite={t.nonfinite}). "
                + (
                    f"The last good checkpoint (its state's next step was finite) is step {last} in "
                    f"{self.ckpt.directory}"
                    if last is not None
                    else "No good checkpoint is left"
                )
                + "; lower train.lr or raise train.warmup_steps"
                + (", or set train.nonfinite=skip to skip such steps" if t.nonfinite == "stop" else "")
            )

    def _meta(self, step: int) -> dict:
        return {
            "data_position": self.position,
            "data_shuffle": self.order,
            "data_identity": self.data.identity,
            "tokens_seen": self.tokens_seen,
            "eval_stopped": self.eval_stopped == step,
            "step": step,
            "skipped_steps": self.skipped,
            "config": json.loads(self.cfg.to_json_best_effort()),
        }


def _finish(run_dir: Path, ckpt, report: Reporter, loop: _Loop, step: int, main_process: bool) -> dict:
    """The run's summary, printed by process 0."""
    evals, writer = report.evals, report.writer
    summary = {
        "run_dir": str(run_dir),
        "checkpoints": str(ckpt.directory),
        "last_checkpoint_step": loop.last_saved,
        "metrics": writer.path,
        "tensorboard": writer.tb_dir,
        "step": step,
        "evals": evals,
        "stopped_by": loop.stopped,
        "skipped_steps": loop.skipped,
    }
    if main_process:
        if evals:
            print(
                f"eval loss: first {evals[0][1]:.4f} (step {evals[0][0]}) -> last {evals[-1][1]:.4f} "
                f"(step {evals[-1][0]})"
            )
        if loop.skipped:
            print(f"{loop.skipped} step(s) were skipped as not finite (train.nonfinite=skip)")
        if loop.stopped:
            print(f"stopped by {loop.stopped} at step {step}; checkpoint saved")
        print(
            f"run dir:      {run_dir}\ncheckpoints:  {ckpt.directory} (last step {loop.last_saved})\n"
            f"metrics:      {writer.path}\ntensorboard:  tensorboard --logdir {writer.tb_dir}"
        )
    return summary


def _batch_slice(mesh, global_batch: int) -> tuple[int, int]:
    """(index, count) of the slice of the global batch this process feeds. Processes whose devices
    hold the same rows (a tensor or pipeline axis spanning processes) must load the same rows."""
    shards = NamedSharding(mesh, P(BATCH_AXES)).addressable_devices_indices_map((global_batch,))
    lo = min(idx[0].start or 0 for idx in shards.values())
    hi = max(global_batch if idx[0].stop is None else idx[0].stop for idx in shards.values())
    return lo // (hi - lo), global_batch // (hi - lo)


def _use_compile_cache(directory: str) -> None:
    """Point JAX's persistent compilation cache at `directory` (created if missing); "" leaves it."""
    if not directory:
        return
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = Path(directory).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"config field `compile_cache`: cannot create {path} ({e.strerror or e}); "
            'choose a writable directory or "" for no cache'
        ) from e
    if jax.config.jax_compilation_cache_dir != str(path):
        cc.set_cache_dir(str(path))
        cc.reset_cache()  # JAX decides once whether to use a cache: ask again with the new directory


# ---------------------------------------------------------------- the command line


def _flag_error(e: Exception, argv) -> None:
    """A misspelt --config.KEY or a missing --config file as a one-line error, not a traceback."""
    why = e
    while isinstance(why, (AttributeError, KeyError)) and why.args:  # unwrap to ml_collections' text
        why = why.args[0]
    why = str(why).replace("\n", "; ")
    if isinstance(e, OSError):
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip().startswith("[Errno")]
        from boost_jax.config import packaged_configs

        print(
            f"error: --config: {lines[0] if lines else why}; give a config file or a packaged config's name "
            f"({', '.join(n for n in packaged_configs() if '/' not in n)})",
            file=sys.stderr,
        )
    else:
        print(
            f"error: {' '.join(argv[1:])}: unknown key {why} (the keys are those of boost_jax/config/schema.py)",
            file=sys.stderr,
        )
    sys.exit(1)


def _config_path(argv) -> str | None:
    """The file `--config FILE` / `--config=FILE` names in argv, if any."""
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _packaged_config(argv) -> list:
    """argv with a `--config NAME` of a packaged config (`cola_60m`, or `configs/cola_60m.py` where
    no such file is: an installed wheel) replaced by its file (boost_jax/config/files.py config_path), and
    moved in front of the `--config.KEY=VALUE` overrides: they apply to the file, in any order given."""
    from boost_jax.config import config_path

    out, picked = [argv[0]] if argv else [], []
    rest = iter(argv[1:])
    for arg in rest:
        if arg.startswith("--config="):
            picked = ["--config=" + config_path(arg.split("=", 1)[1])]
        elif arg == "--config":
            value = next(rest, None)
            picked = ["--config"] + ([] if value is None else [config_path(value)])
        else:
            out.append(arg)
    return out[:1] + picked + out[1:]


def _define_config(argv, flag_values=None):
    from ml_collections import config_flags

    from boost_jax.config import load_config_file

    path = _config_path(argv)
    if path:  # a broken file as one line naming it (ml_collections would raise from inside its parser)
        try:
            load_config_file(path, "--config", run_config=True)
        except FileNotFoundError:
            pass  # reported by _flag_error below, as before
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)
    kw = {} if flag_values is None else {"flag_values": flag_values}
    try:  # the config file is loaded and the overrides resolved already here and in parsing
        config_flags.DEFINE_config_file(
            "config", str(DEFAULT_CONFIG), "Run config file (configs/*.py)", lock_config=True, sys_argv=argv, **kw
        )
    except (AttributeError, KeyError, OSError) as e:
        _flag_error(e, argv)


def parse_config(argv):
    """The config `python -m boost_jax.train ARGV...` would run (argv[0] is the program name), parsed
    exactly as the command line does it, on private flags (so it may be called many times)."""
    from absl import flags

    fv = flags.FlagValues()
    argv = _packaged_config(argv)
    _define_config(argv, fv)
    try:
        fv(argv)
        cfg = fv.config
        cfg.name  # noqa: B018 - a config file that failed to load raises on first use
    except (AttributeError, KeyError, OSError) as e:
        _flag_error(e, argv)
    except flags.Error as e:
        _flags_error(e)
    return cfg


USAGE = """Pre-train a model: python -m boost_jax.train [--config FILE|NAME] [--config.KEY=VALUE ...]
(also: boost-train). Without flags it trains the tiny CoLA model on the embedded corpus.

  --config FILE|NAME   a config file (configs/cola_60m.py) or a packaged config's name (cola_60m);
                       default: tiny
  --config.KEY=VALUE   override one key (below; a misspelt key is an error)
  --print_config       print the resolved config (file + overrides) and exit
  --help               this text

Config keys, their defaults (boost_jax/config/schema.py; a config file changes some) and meaning:"""


def _help(argv) -> bool:
    """--help / --print_config: print and return True (the command exits 0)."""
    if any(a in HELP_FLAGS for a in argv[1:]):
        from boost_jax.config import describe_config

        _print(USAGE + "\n" + describe_config())
        return True
    if "--print_config" in argv[1:]:
        cfg = parse_config([a for a in argv if a != "--print_config"])
        _print(str(cfg) + "\n" + _autos_here(cfg))
        return True
    return False


def _autos_here(cfg) -> str:
    """What the config's `auto` fields resolve to on the devices JAX sees here (model/autos.py)."""
    from boost_jax.parallel.mesh import mesh_devices

    try:
        devices = mesh_devices(cfg.parallel)
        picks = autos.chosen(cfg, len(devices), devices)
    except ConfigError as e:
        return f"# auto: not resolved on this machine's devices ({e})"
    where = f"{len(devices)} x {devices[0].device_kind}"
    return f"# auto, on {where}: " + (autos.describe(picks) or "nothing left to resolve")


HELP_FLAGS = ("--help", "-h", "--helpfull", "--helpshort", "--helpxml", "-?")  # absl's too: all print ours


def _print(text: str) -> None:
    """Print to stdout; a reader that closed the pipe early (`| head`) ends it quietly, not with a
    BrokenPipeError traceback."""
    import os

    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush goes nowhere


def _flags_error(e: Exception) -> None:
    """A command line absl cannot parse (a flag that is not ours, a flag without its value) as one line
    pointing at our --help, not at absl's."""
    print(
        f"error: {str(e).splitlines()[0]}; python -m boost_jax.train --help lists the flags and every config key",
        file=sys.stderr,
    )
    sys.exit(1)


def main(argv=None) -> int:
    from absl import app, flags

    argv = _packaged_config(sys.argv if argv is None else argv)
    if _help(argv):
        return 0
    _define_config(argv)

    def parse(args):
        try:
            return flags.FLAGS(args)
        except (AttributeError, KeyError, OSError) as e:
            _flag_error(e, args)
        except flags.Error as e:  # (absl's own parse_flags_with_usage would suggest absl's --helpshort)
            _flags_error(e)

    stop = StopFlag()

    def _main(_):
        try:
            cfg = flags.FLAGS.config
            cfg.name  # noqa: B018 - a config file that failed to load raises on first use
        except OSError as e:
            _flag_error(e, argv)
        try:
            run(
                cfg, stop.__enter__(), _config_path(argv) or str(DEFAULT_CONFIG)
            )  # stop: never uninstalled: a signal after the final save is absorbed too
        except ERRORS as e:
            print(error_lines(e), file=sys.stderr)
            sys.exit(1)
        finally:  # the interpreter's shutdown can drop the handlers: a late signal would end it with 143
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)

    app.run(_main, argv=argv, flags_parser=parse)
    return 0


if __name__ == "__main__":
    main()
