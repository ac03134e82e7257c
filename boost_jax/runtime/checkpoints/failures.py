"""How a failed checkpoint read or write is reported: in one line (`one_line`, the operating system's
reason `os_reason`, a full or read-only run dir `cannot_write`), without the noise Orbax and
TensorStore print around it (`quiet_orbax_errors`, `quiet_closed_loop`). store.py uses
them and re-exports them."""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
from pathlib import Path

from boost_jax.errors import CheckpointError


def one_line(e: Exception, width: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= width else text[:width] + " ..."


def store_reason(e: Exception, step_dir) -> str | None:
    """A TensorStore read error (Orbax's array reads) in one clean line: its status, the array it read
    and its innermost cause, paths relative to `step_dir`, without the spec TensorStore appends
    (`[tensorstore_spec='{...}']`, the JSON of its whole driver stack) or its chain of driver
    openings; None for other errors."""
    text = " ".join(str(e).split())
    if "tensorstore_spec" not in text and "driver: Error" not in text:
        return None
    text = re.split(r"\s*\[(?:tensorstore_spec|source locations)", text)[0]
    code = re.match(r"([A-Z_]+): ", text)
    array = re.search(r'Error reading "([^"]+?)/?\.zarray"', text)
    cause = re.split(r":\s*(?=Error )", text)[-1].replace(f"{step_dir}/", "")
    return (
        f"{code.group(1) if code else 'error'}"
        + (f" reading the array {array.group(1)}" if array else "")
        + f": {one_line(cause, 200)}"
    )


def os_reason(e: Exception) -> str | None:
    """The operating system's reason inside a write's exception, e.g. "No space left on device
    [ENOSPC]": tensorstore reports it deep in a long message (`[os_error_code='28']`) that a one-line
    report would cut off."""
    code = re.search(r"os_error_code='(\d+)'", str(e))
    if code is None:
        return None
    number = int(code.group(1))
    return f"{os.strerror(number)} [{errno.errorcode.get(number, number)}]"


def _closed_loop_noise(unraisable) -> bool:
    """A read that failed leaves TensorStore callbacks that run after Orbax closed their asyncio loop:
    each raises 'Event loop is closed' where nobody can catch it (Python prints it as ignored)."""
    e = unraisable.exc_value
    return isinstance(e, RuntimeError) and str(e) == "Event loop is closed"


def quiet_closed_loop() -> None:
    """Drop `_closed_loop_noise` from the unraisable-exception report (the failed read itself is
    reported as one line); other unraisable exceptions are reported as before. Installed once."""
    previous = sys.unraisablehook
    if getattr(previous, "_boost_jax", False):
        return

    def hook(unraisable):
        if not _closed_loop_noise(unraisable):
            previous(unraisable)

    hook._boost_jax = True
    sys.unraisablehook = hook


class _OrbaxErrors(logging.Filter):
    """Drops Orbax's own ERROR records (a failed save logs hundreds of lines of tracebacks from its
    background threads), and those of the asyncio and thread-pool machinery its writers run on (a
    save failing mid-way leaves futures whose loop has closed); the Checkpointer reports the failure
    as one line (`Checkpointer._failed`, store.py)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.levelno >= logging.ERROR
            and ("orbax" in record.pathname.replace("\\", "/") or record.name in ("asyncio", "concurrent.futures"))
        )


def quiet_orbax_errors() -> None:
    """Install `_OrbaxErrors` where Orbax's records pass: absl's logger and the handlers of the root
    logger and of absl (records of child loggers skip their parents' logger filters), once each; and
    `_closed_loop_is_quiet` as the hook for exceptions nothing can catch."""
    from absl import logging as absl_logging

    targets = [logging.getLogger("absl"), *logging.getLogger().handlers, absl_logging.get_absl_handler()]
    for target in targets:
        if not any(isinstance(f, _OrbaxErrors) for f in target.filters):
            target.addFilter(_OrbaxErrors())
    if getattr(sys.unraisablehook, "__wrapped__", None) is None:
        sys.unraisablehook = _closed_loop_is_quiet(sys.unraisablehook)


def _closed_loop_is_quiet(previous):
    """A hook for unraisable exceptions that drops one kind: "Event loop is closed" raised in asyncio's
    `call_soon_threadsafe`, which tensorstore's writer threads call to complete the futures of a save
    whose event loop Orbax closed when the save failed (a full disk: their traceback, printed with no
    context, would follow the failure's one-line report). Every other exception goes to `previous`."""

    def hook(unraisable):
        tb, frames = unraisable.exc_traceback, []
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_name)
            tb = tb.tb_next
        if not (
            unraisable.exc_type is RuntimeError
            and str(unraisable.exc_value) == "Event loop is closed"
            and "call_soon_threadsafe" in frames
        ):
            previous(unraisable)

    hook.__wrapped__ = previous
    return hook


WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)


def cannot_write(e: OSError, checkpoints: Path) -> CheckpointError | None:
    """A write under the run dir that failed (a full disk, a read-only mount) as one line naming the
    file and the last good checkpoint; None for other OSErrors."""
    if e.errno not in WRITE_ERRNOS:
        return None
    steps = [int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()] if checkpoints.is_dir() else []
    last = f"step {max(steps)} in {checkpoints}" if steps else f"none (nothing in {checkpoints})"
    why = f"{e.strerror} [{errno.errorcode.get(e.errno, e.errno)}]" if e.strerror else str(e)
    return CheckpointError(
        f"cannot write {e.filename or checkpoints.parent} ({why}); the last good checkpoint is "
        f"{last}: free some space (or make it writable) and rerun to resume from it"
    )
