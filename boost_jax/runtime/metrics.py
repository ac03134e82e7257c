"""Throughput, MFU and the metric writers (JSONL always, TensorBoard when available)."""

from __future__ import annotations

import atexit
import json
import math
import os
import sys

# Dense bf16 peak FLOP/s per device, matched against `device.device_kind` by substring.
PEAK_BF16_FLOPS = [
    ("H200", 989e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("V100", 125e12),
    ("TPU v6", 918e12),
    ("TPU v5p", 459e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v4", 275e12),
]


def peak_flops(device_kind: str) -> float | None:
    for key, value in PEAK_BF16_FLOPS:
        if key.lower() in device_kind.lower():
            return value
    return None


def throughput(tokens: int, seconds: float, flops_per_token: float, n_devices: int, device_kind: str) -> dict:
    tok_s = tokens / max(seconds, 1e-9)
    tflops = flops_per_token * tok_s / n_devices / 1e12
    peak = peak_flops(device_kind)
    return {"tokens_per_s": tok_s, "tflops_per_device": tflops, "mfu": (tflops * 1e12 / peak) if peak else None}


def fmt_mfu(mfu) -> str:
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"


def set_aside_torn_tail(path: str, block: int = 1 << 16) -> int:
    """A file a killed run left ending mid-line: append the bytes after its last newline to PATH.torn
    (one line per tear) and truncate PATH there, so the next row starts on a line of its own.
    Returns the number of bytes set aside (0 when the file is missing, empty or whole)."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return 0
    with open(path, "r+b") as f:
        end = f.seek(0, os.SEEK_END)
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return 0
        cut = 0  # just past the last newline; 0 when there is none
        pos = end
        while pos > 0:  # read backwards a block at a time: the file may be large
            start = max(0, pos - block)
            f.seek(start)
            found = f.read(pos - start).rfind(b"\n")
            if found >= 0:
                cut = start + found + 1
                break
            pos = start
        f.seek(cut)
        tail = f.read()
        with open(path + ".torn", "ab") as side:
            side.write(tail + b"\n")
        f.truncate(cut)
    print(
        f"note: {path} ended in a partial line ({len(tail)} bytes, a run stopped mid-write); moved it to {path}.torn",
        file=sys.stderr,
    )
    return len(tail)


class MetricsWriter:
    """Appends one JSON object per record to metrics.jsonl and mirrors scalars to TensorBoard. A torn
    last line left by a killed run is set aside (set_aside_torn_tail) before the first new row.

    TensorBoard is a mirror: its directory removed under a running trainer is recreated (with a
    note), and a TensorBoard write that fails (a full disk) stops the mirroring with one note, never
    the run; metrics.jsonl stays the record. A failed flush at close leaves no exit-time retries."""

    def __init__(self, run_dir: str, enabled: bool = True, note=None):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tb_dir = os.path.join(run_dir, "tensorboard")
        self._tb = None
        self._failed: list = []  # OSErrors of tensorboardX's logger threads (a full disk): see _guard
        self._note = note or (lambda text: print(text, file=sys.stderr))
        if enabled:
            try:
                from tensorboardX import SummaryWriter

                self._tb = _guard(SummaryWriter(self.tb_dir), self._failed)
                atexit.register(self._at_exit)  # runs before tensorboardX's own exit hook (LIFO)
            except ImportError:
                self.tb_dir = None
            set_aside_torn_tail(self.path)

    def _at_exit(self) -> None:
        """A writer not closed (a run ended by an error): closed quietly, or given up on a full disk."""
        if self._tb is not None:
            tb, self._tb = self._tb, None
            try:
                tb.close()
            except Exception:  # noqa: BLE001 - at exit there is no one left to tell
                _abandon(tb)

    def write(self, step: int, record: dict) -> None:
        if not self.enabled:
            return
        # NaN/inf are not JSON: such a value is left out of the row, like a missing one.
        row = {
            "step": int(step),
            **{
                k: v for k, v in record.items() if v is not None and not (isinstance(v, float) and not math.isfinite(v))
            },
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            self._mirror(step, row)

    def _mirror(self, step: int, row: dict) -> None:
        try:
            if not os.path.isdir(self.tb_dir):  # removed under the run: its event file is gone with it
                from tensorboardX import SummaryWriter

                _abandon(self._tb)
                self._tb = _guard(SummaryWriter(self.tb_dir), self._failed)
                self._note(
                    f"note: {self.tb_dir} was removed while training; recreated it from step {step} "
                    f"(the earlier scalars are in {self.path})"
                )
            if self._failed:  # a logger thread's write or flush failed since the last row
                raise self._failed[0]
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
        except OSError as e:
            _abandon(self._tb)
            self._tb = None
            self._note(
                f"note: TensorBoard logging stopped at step {step} (cannot write {self.tb_dir}: "
                f"{e.strerror or e}); {self.path} goes on"
            )

    def close(self) -> None:
        atexit.unregister(self._at_exit)
        if self._tb is not None:
            tb, self._tb = self._tb, None
            try:
                tb.close()
            except Exception:
                _abandon(tb)  # no second flush (and traceback) from tensorboardX's exit hook
                raise


class _Guarded:
    """A logger thread's record writer whose OSErrors (a full disk) are kept for the trainer's thread,
    not raised in the logger thread (where they print a traceback at any moment)."""

    def __init__(self, inner, failed: list):
        self._inner, self._failed = inner, failed

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def write_event(self, event):
        try:
            self._inner.write_event(event)
        except OSError as e:
            self._failed.append(e)

    def flush(self):
        try:
            self._inner.flush()
        except OSError as e:
            self._failed.append(e)


def _guard(tb, failed: list):
    """tensorboardX's logger threads write through `_Guarded` (their failures land in `failed`)."""
    for writer in list((getattr(tb, "all_writers", None) or {}).values()):
        worker = getattr(getattr(writer, "event_writer", None), "_worker", None)
        if worker is not None and hasattr(worker, "_record_writer"):
            worker._record_writer = _Guarded(worker._record_writer, failed)
    return tb


def _abandon(tb) -> None:
    """Give up a tensorboardX writer without flushing it: its logger threads stopped and its event
    writers marked closed, so neither they nor tensorboardX's exit hook write (and fail) again."""
    for writer in list((getattr(tb, "all_writers", None) or {}).values()):
        events = getattr(writer, "event_writer", None)
        if events is None or getattr(events, "_closed", True):
            continue
        events._closed = True
        worker = getattr(events, "_worker", None)
        try:
            if worker is not None and worker.is_alive():
                worker.stop()
            events._ev_writer.close()
        except Exception:  # noqa: BLE001 - the file may be gone or unwritable; nothing is left to save
            pass
