"""What a run reports while it trains: metrics.jsonl + TensorBoard, the progress bar, throughput and
MFU over each logging window, evaluations, and an optional profiler trace."""

from __future__ import annotations

import math
import os
import sys
import time

import jax
from tqdm import tqdm

from boost_jax import config as config_lib
from boost_jax.runtime.metrics import MetricsWriter, fmt_mfu, throughput


def _num(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def bar_width(stream) -> dict:
    """tqdm's width settings for a bar on `stream`: the terminal's width as it changes, or a fixed 80
    columns (24 rows) where the terminal reports a size of 0 x 0 (a pseudo-terminal nobody sized: tqdm
    would draw nothing at all)."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):  # not a terminal: tqdm writes plain lines
        return {"dynamic_ncols": True}
    return {"dynamic_ncols": True} if columns > 0 else {"ncols": 80, "nrows": 24}  # (tqdm asks for both)


class Reporter:
    """Metrics (process 0 writes), the progress bar and the throughput window of one run."""

    def __init__(
        self,
        run_dir,
        *,
        name: str,
        steps: int,
        tokens_per_step: int,
        progress: bool,
        main_process: bool,
        flops_per_token: float,
    ):
        self.main = main_process
        self.writer = MetricsWriter(str(run_dir), enabled=main_process, note=lambda text: self.note(text))
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.device_kind, self.n_devices = jax.devices()[0].device_kind, jax.device_count()
        self.evals: list[tuple[int, float]] = []
        self.bar = None
        self.name, self.total, self.progress = name, steps, progress
        self.window_start, self.window_steps, self.window_tokens = time.perf_counter(), 0, 0

    def start_bar(self, step: int) -> None:
        # smoothing=0: the rate is the steps since the compile over the time since (see _compiled), the
        # steady average. The loop counts a step when the device has finished it (train_loop.py
        # _count_done); miniters=1: tqdm redraws whenever mininterval has passed, never letting a burst
        # of fast steps raise the count it waits for between redraws.
        self.bar = tqdm(
            total=self.total,
            initial=step,
            disable=not (self.main and self.progress),
            desc=self.name,
            unit="step",
            smoothing=0,
            miniters=1,
            **bar_width(sys.stderr),
        )
        self.first_step = step + 1  # this process's first step: its call traces and compiles the program
        self.window_start, self.window_steps, self.window_tokens = time.perf_counter(), 0, 0

    def note(self, text: str) -> None:
        if self.main:
            (self.bar.write if self.bar is not None else print)(text)

    def write(self, step: int, record: dict) -> None:
        self.writer.write(step, record)

    def step_done(self) -> None:
        self.bar.update(1)
        self.window_steps += 1
        if self.bar.n == self.first_step:
            self._compiled()

    def _compiled(self) -> None:
        """After the first step, which waited for the compile: say how long it took and restart the
        bar's clock, so that its rate and time left count only the steps that follow (a 20 s compile
        read as a step's time would predict hours for a run of minutes)."""
        took, n = time.perf_counter() - self.window_start, self.bar.n
        self.note(f"step {n} took {took:.1f} s with the compile; the progress bar times the steps after it")
        self.bar.reset()  # the clock and the smoothed rate start afresh (and the count at 0)
        self.bar.n = self.bar.initial = self.bar.last_print_n = n
        self.bar.refresh()

    def count_tokens(self, n: int) -> None:
        """Input tokens of a finished step that are not padding (what tokens/s and MFU count)."""
        self.window_tokens += n

    def log(self, step: int, m: dict, skipped: int, extra: dict) -> dict:
        """One logging window: loss, perplexity, grad norm, lr, step time, tokens/s, TFLOP/s, MFU, and
        the fraction of row slots that were padding (data.batching packed/document); returns the record."""
        elapsed = time.perf_counter() - self.window_start
        rate = throughput(self.window_tokens, elapsed, self.flops_per_token, self.n_devices, self.device_kind)
        slots = self.tokens_per_step * self.window_steps
        if "tokens" in m:
            extra = {"pad_fraction": 1.0 - self.window_tokens / max(slots, 1), **extra}
        # A batch of documents without a single target has no loss (its sum over no targets reads 0).
        loss = _num(m["loss"]) if m["finite"] and int(m.get("targets", 1)) > 0 else None
        record = {
            "loss": loss,
            "perplexity": None if loss is None else math.exp(min(loss, 50.0)),
            "grad_norm": _num(m["grad_norm"]),
            "lr": float(m["lr"]),
            "skipped_steps": skipped,
            "step_time_s": elapsed / self.window_steps,
            **rate,
            **extra,
        }
        self.writer.write(step, record)
        self.bar.set_postfix(
            loss="skipped" if loss is None else f"{loss:.3f}",
            tok_s=f"{rate['tokens_per_s']:.0f}",
            mfu=fmt_mfu(rate["mfu"]),
        )
        self.window_start, self.window_steps, self.window_tokens = time.perf_counter(), 0, 0
        return record

    def eval(self, step: int, result, say: bool = True) -> None:
        """result: the eval loss, or runtime/evaluation.py's dict (then CoLA's reported form is logged
        beside it as `eval_loss_cola`, and the rows and tokens read as `eval_rows`, `eval_tokens`)."""
        loss = result["loss"] if isinstance(result, dict) else result
        got = result if isinstance(result, dict) else {}
        cola = got.get("cola_loss")
        self.evals.append((step, loss))
        counts = {f"eval_{k}": got[k] for k in ("rows", "tokens") if k in got}
        self.writer.write(step, {"eval_loss": loss, **({} if cola is None else {"eval_loss_cola": cola}), **counts})
        if say and self.main:
            self.bar.write(
                f"step {step}: eval loss {loss:.4f}" + ("" if cola is None else f" (CoLA's reported form {cola:.4f})")
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.writer.close()


class Profiler:
    """A jax.profiler trace of train steps [first, last] (1-based, `profile_steps`) into `directory`."""

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
            self.say(
                f"profile of steps {self.range[0]}..{step} written to {self.directory} "
                f"(tensorboard --logdir {self.directory}, profile tab)"
            )
