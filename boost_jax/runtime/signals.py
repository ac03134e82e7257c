"""Signals a run survives: SIGTERM, SIGINT, SIGHUP (the terminal or ssh session closed) and
SIGUSR1/SIGUSR2 (what `sbatch --signal` sends before a time limit) stop it after the step in
progress, with a checkpoint.

`StopFlag` is installed for the whole process by the command line (train.main), so a signal that
arrives after the final save is absorbed too; `agree` makes every process of a multi-process run stop
at the same step.
"""

from __future__ import annotations

import os
import signal

import numpy as np

# Every signal that stops a run with a checkpoint (those this platform has).
STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2") if hasattr(signal, name)
)


def agree(signal_name):
    """The signal any process received, or None; a collective, so all processes call it together."""
    from jax.experimental import multihost_utils

    got = multihost_utils.process_allgather(np.int32(signal_name is not None))
    return (signal_name or "SIGTERM") if np.any(got) else None


def _say(text: str) -> None:
    os.write(2, (text + "\n").encode())  # safe inside a signal handler (print is not reentrant)


class StopFlag:
    """A stop signal (STOP_SIGNALS) sets a flag; the loop saves, waits for the save, and exits cleanly.

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
        for sig in STOP_SIGNALS:
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
            resume = "from scratch" if safe is None else f"from step {safe}"
            _say(
                f"{name} a third time: exiting without finishing the checkpoint; a rerun resumes {resume} "
                "and everything trained after it is lost"
            )
            os._exit(130)
        else:
            _say(
                f"{name} again: still stopping; waiting for the checkpoint to be written"
                + (" (a third SIGINT abandons it)" if signum == signal.SIGINT else "")
            )

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
