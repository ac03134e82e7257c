"""The directory `data.prepare` writes (--out): its locks (one run at a time; a rerun waits for the
workers of an earlier one), its creation, files written whole or not at all, and the clean-up of
unfinished `.tmp` files; an OSError in words."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sys
import time
from pathlib import Path

from boost_jax.data.sources import INDEX
from boost_jax.errors import PrepareError

PLAN = "plan.json"
LOCK = ".lock"
WORKERS_LOCK = ".workers.lock"


class WriteError(Exception):
    """An OSError writing under --out (args: path, reason), here or in a worker (it pickles)."""


def error_reason(e: BaseException) -> str:
    """An OSError's errno text, e.g. 'No space left on device [ENOSPC]'."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror} [{errno.errorcode.get(e.errno, e.errno)}]"
    return str(e) or type(e).__name__


def unlink_quietly(paths) -> None:
    for path in paths:
        try:
            Path(path).unlink(missing_ok=True)
        except OSError:
            pass


def write_whole(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all (into path.tmp, then renamed); an OSError is a WriteError."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        unlink_quietly([tmp])
        raise WriteError(str(path), error_reason(e)) from None


class OutLock:
    """An exclusive flock on OUT/.lock while one prepare() writes there (the file names its holder)."""

    def __init__(self, out: Path):
        self.out, self._fd = out, None

    def __enter__(self):
        try:
            fd = os.open(self.out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise PrepareError(
                f"--out {self.out}: cannot write {self.out / LOCK} ({error_reason(e)}); choose a writable directory"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.read(fd, 4096))
                who = f"pid {holder['pid']}, since {holder['since']}"
            except (OSError, ValueError, KeyError, TypeError):
                who = "pid unknown"
            os.close(fd)
            raise PrepareError(
                f"another data.prepare is writing {self.out} ({who}); wait for it or choose another --out"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        except OSError:
            pass  # (a full disk) the lock holds all the same; only its note on the holder is missing
        self._fd = fd
        return self

    def __exit__(self, *exc):
        os.close(self._fd)  # drops the flock; the file stays (its text only names the holder)


def make_out(out: Path) -> None:
    """Create --out (and its parents), with a one-line error where a file is in the way."""
    for p in (out, *out.parents):
        if p.exists():  # the deepest existing one
            if not p.is_dir():
                where = "is a file" if p == out else f"is under the file {p}"
                raise PrepareError(f"--out {out} {where}, not a directory; choose a directory (created if missing)")
            break
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PrepareError(f"--out {out}: cannot create it ({error_reason(e)}); choose a writable directory") from None


def wait_for_workers(out: Path, say=lambda text: print(text, file=sys.stderr)) -> None:
    """Wait until no worker of an earlier run on `out` is alive (each holds a shared lock on
    OUT/.workers.lock; they die with their main process, so this is short)."""
    try:
        fd = os.open(out / WORKERS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return  # (an unwritable --out is reported where the run first writes)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"note: waiting for the workers of an earlier data.prepare on {out} to exit")
            fcntl.flock(fd, fcntl.LOCK_EX)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def remove_tmp(out: Path) -> None:
    """The .tmp files of unfinished units (only ever ours: the caller holds the lock)."""
    unlink_quietly(
        p for p in out.glob("*.tmp") if p.name.startswith("shard_") or p.name in (f"{PLAN}.tmp", f"{INDEX}.tmp")
    )
