"""The trainer's loop (boost_jax/train.py runs it): a step per batch; at each log or save point the
health checks (non-finite steps, signals), the report, evaluation and the checkpoint."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import jax

from boost_jax.data.mapped import Truncated, check_sizes
from boost_jax.errors import TrainingDiverged
from boost_jax.kernels.rmsnorm import kernels_used
from boost_jax.runtime.build import to_global
from boost_jax.runtime.evaluation import EvalInterrupted
from boost_jax.runtime.report import Profiler
from boost_jax.runtime.signals import StopFlag, agree

PREDICTION_WINDOWS = 3  # parallel.plan=auto: logged step times compared with the planner's prediction
MAX_SKIPPED_IN_A_ROW = 20  # train.nonfinite=skip still stops when the run has clearly diverged
IN_FLIGHT = 2  # steps dispatched ahead of the device: the next batch is read while the device computes


def stop_requested(stop: StopFlag) -> bool:
    """Whether a stop signal came (to any process: then all agree, a collective)."""
    return (agree(stop.signal) if jax.process_count() > 1 else stop.signal) is not None


class TrainLoop:
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
        self.in_flight = collections.deque()  # metrics of the dispatched steps not yet counted as done
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
            self._check_data()
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
            self.in_flight.append(metrics)
            self._count_done(IN_FLIGHT)
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
            self._count_done(0)
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
                self.report.eval(step, self.evaluate(self.state["params"], stop=lambda: stop_requested(self.stop)))
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

    def _count_done(self, keep: int) -> None:
        """Wait until at most `keep` dispatched steps are unfinished, advancing the progress bar by each
        step that finished: the bar moves with the steps the device completes, whatever log_every is
        (dispatch alone would run it ahead, then stop it at the next log point)."""
        while len(self.in_flight) > keep:
            jax.block_until_ready(self.in_flight.popleft())
            self.report.step_done()

    def _check_data(self) -> None:
        """A token file shrunk under the run: stop cleanly before the next batch's read faults (a stat
        per mapped file), the save in flight finished, saying what a rerun resumes from. (Several
        processes might see a truncation at different steps: one process only.)"""
        if jax.process_count() > 1:
            return
        try:
            check_sizes(self.mapped)
        except Truncated as e:
            self.ckpt.wait()
            last = self.ckpt.committed_step()
            raise Truncated(
                e.path,
                "the run starts from the start (no checkpoint was complete)"
                if last is None
                else f"the run resumes from step {last}, its last complete checkpoint",
            ) from None

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
