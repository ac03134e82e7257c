"""Token files are memory-mapped; one truncated (or rewritten shorter) on disk while a run reads it
makes the next read of a page past its new end raise SIGBUS, which would end the process with
"Fatal Python error: Bus error" and a traceback. `watch` records each mapping's address range and
its file; a SIGBUS handler (Linux, installed with the first mapping) that finds the faulting address
in one of them prints one line naming the file and exits with status 1. Checkpoints are unaffected:
a finished step stays complete, and a save in flight leaves only its temporary directory, which the
next start removes. A SIGBUS outside the recorded mappings goes to the handler installed before
(faulthandler's, or the default action). Before that, the trainer compares the sizes of its files
with those they had when mapped before it reads each batch (`check_sizes`), so a truncation stops the
run with the same line through its normal exit, the save in flight finished.

The handler runs Python code in the signal's context, which is only safe because it ends the
process: it formats one line, writes it with os.write and calls os._exit.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_RANGES: list[tuple[int, int, str]] = []  # (first byte, end, path) of every mapping watched
_MAPPED: list[tuple[str, int]] = []  # (path, size in bytes) of each file when it was mapped, in order
_INSTALLED: list = []  # the ctypes callback (kept alive while installed)
SA_SIGINFO = 4
SI_CODE_OFFSET = 8  # siginfo_t: si_signo, si_errno, si_code (<= 0: sent by a process, not a fault), padding,
SI_ADDR_OFFSET = 16  # then the union (si_addr first)


def watch(array, path):
    """Record `array` (a memory map of `path`) so that a SIGBUS reading it names the file; returns it."""
    if getattr(array, "nbytes", 0):
        start = array.ctypes.data
        _RANGES.append((start, start + array.nbytes, str(path)))
        try:
            _MAPPED.append((str(path), os.path.getsize(path)))
        except OSError:  # (gone already: nothing to compare with)
            pass
        _install()
    return array


def mark() -> int:
    """A position in the record of mappings: `mapped_since(mark())` taken later lists those made since."""
    return len(_MAPPED)


def mapped_since(position: int) -> dict[str, int]:
    """{path: size when mapped} of the files mapped after `position` (e.g. by one build_loaders)."""
    return dict(_MAPPED[position:])


RERUN = "the run resumes from its newest complete checkpoint (from the start if it has none)"


class Truncated(ValueError):
    """A mapped token file became shorter than when it was mapped (`path`)."""

    def __init__(self, path: str, rerun: str = RERUN):
        self.path = path
        super().__init__(message(path, rerun)[len("error: ") :].rstrip("\n"))


def check_sizes(files: dict[str, int]) -> None:
    """Raise Truncated (a ValueError: the same one line) if one of `files` is now shorter than when it
    was mapped: the trainer asks before it reads each batch, so a truncation stops the run cleanly (its
    save in flight finished) before a read of the lost pages would."""
    for path, size in files.items():
        try:
            now = os.path.getsize(path)
        except OSError:  # removed or renamed: the mapping keeps the file's pages, reads go on
            continue
        if now < size:
            raise Truncated(path)


def owner(address: int | None) -> str | None:
    """The watched file whose mapping holds `address`, if any."""
    if address is None:
        return None
    return next((path for lo, hi, path in reversed(_RANGES) if lo <= address < hi), None)


def message(path: str, rerun: str = RERUN) -> str:
    """The one line for `path` truncated under the run; `rerun`: what a rerun does (the trainer, which
    knows its checkpoints, says which step)."""
    return (
        f"error: {path}: this memory-mapped token file became shorter while the run read it (truncated or "
        f"rewritten on disk); restore it (or prepare it again) and rerun: {rerun}\n"
    )


def _install() -> None:
    if _INSTALLED or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)

    class Sigaction(ctypes.Structure):
        _fields_ = [
            ("sa_sigaction", handler_type),
            ("sa_mask", ctypes.c_ulong * 16),
            ("sa_flags", ctypes.c_int),
            ("sa_restorer", ctypes.c_void_p),
        ]

    def on_sigbus(signum, info, context):
        address = ctypes.c_void_p.from_address(info + SI_ADDR_OFFSET).value if info else None
        path = owner(address)
        if path is None:  # not a watched file: the previous handler (or the default) when it faults again
            libc.sigaction(signal.SIGBUS, ctypes.byref(previous), None)
            sent = not info or ctypes.c_int.from_address(info + SI_CODE_OFFSET).value <= 0
            if sent:  # no fault to repeat it: deliver it again, to that handler
                getattr(libc, "raise")(signal.SIGBUS)
            return
        os.write(2, message(path).encode(errors="replace"))
        os._exit(1)

    callback = handler_type(on_sigbus)
    action, previous = Sigaction(sa_sigaction=callback, sa_flags=SA_SIGINFO), Sigaction()
    if libc.sigaction(signal.SIGBUS, ctypes.byref(action), ctypes.byref(previous)) == 0:
        _INSTALLED.extend([callback, previous])
