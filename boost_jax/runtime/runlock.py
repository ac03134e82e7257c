"""One trainer per run directory: an exclusive lock on RUN_DIR/.lock, holding the owner's host and pid.

The lock is an `flock` on the file, which the kernel drops when its holder exits in any way (SIGKILL
included), so a lock left by a dead run is stale by construction and is simply taken over; the file's
text only serves to tell a second trainer who holds it. (On network filesystems flock is as good as
the filesystem's lock support: NFSv4 and Lustre with `flock` mounts honour it.)
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from boost_jax.errors import RunDirBusy


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ".lock"
        self._fd = None

    def acquire(self) -> "RunLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace")
            os.close(fd)
            try:
                h = json.loads(holder)
                who = f"host {h['host']} pid {h['pid']} (since {h['since']})"
            except (ValueError, KeyError, TypeError):
                who = "another process"
            raise RunDirBusy(f"config field `run_dir`: {self.path.parent} is in use by a trainer on {who}; "
                             "wait for it, stop it, or choose another run_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (its text is only informative)
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
