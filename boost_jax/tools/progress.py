"""Progress on stderr for a command's long steps that have no count to show (a plan search, an XLA
compile): a line when the step starts, then its elapsed time, updated in place on a terminal (every
second) or as a new line every `every` seconds in a log, and the time it took when it ends."""
from __future__ import annotations

import contextlib
import sys
import threading
import time


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


@contextlib.contextmanager
def ticking(what: str, every: float = 15.0, file=None):
    """`with ticking("searching 32-GPU plans"):` prints `what...` at once, the elapsed time while the
    body runs, and `what: done in M:SS` after it. When the body raises, nothing more (on a terminal
    the line is cleared): the command's one-line error says what happened."""
    out = file if file is not None else sys.stderr
    tty = hasattr(out, "isatty") and out.isatty()
    start, done = time.perf_counter(), threading.Event()

    def write(text: str) -> None:
        try:
            out.write(text)
            out.flush()
        except (OSError, ValueError):  # a closed stream: progress is never worth a failure
            pass

    def tick() -> None:
        while not done.wait(1.0 if tty else every):
            elapsed = _clock(time.perf_counter() - start)
            write(f"\r{what}... {elapsed}" if tty else f"{what}... {elapsed}\n")

    write(f"{what}..." if tty else f"{what}...\n")
    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        done.set()
        thread.join()
        if ok:
            write(f"{chr(13) if tty else ''}{what}: done in {_clock(time.perf_counter() - start)}\n")
        elif tty:
            write("\r\033[K")
