"""Progress on stderr for a command's long steps that have no count to show (a plan search, an XLA
compile): once a step has run for `after` seconds, its name and elapsed time, updated in place on a
terminal (every second) or as a new line every `every` seconds in a log, and the time it took when it
ends. A step shorter than `after` prints nothing."""

from __future__ import annotations

import contextlib
import sys
import threading
import time


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


@contextlib.contextmanager
def ticking(what: str, after: float = 5.0, every: float = 15.0, file=None):
    """`with ticking("plan: searching plans for 32 GPUs"):` prints `what... 0:05` once the body has run
    for `after` seconds, then the elapsed time, and `what: done in M:SS` when it ends. When the body
    raises, nothing more (on a terminal the line is cleared): the command's one-line error says what
    happened."""
    out = file if file is not None else sys.stderr
    tty = hasattr(out, "isatty") and out.isatty()
    start, done, shown = time.perf_counter(), threading.Event(), []

    def write(text: str) -> None:
        try:
            out.write(text)
            out.flush()
        except (OSError, ValueError):  # a closed stream: progress is never worth a failure
            pass

    def tick() -> None:
        wait = after
        while not done.wait(wait):
            elapsed = _clock(time.perf_counter() - start)
            write(f"\r{what}... {elapsed}" if tty else f"{what}... {elapsed}\n")
            shown.append(1)
            wait = 1.0 if tty else every

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        done.set()
        thread.join()
        if shown and ok:
            write(f"{chr(13) if tty else ''}{what}: done in {_clock(time.perf_counter() - start)}\n")
        elif shown and tty:
            write("\r\033[K")
