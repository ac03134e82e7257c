"""One trainer per run directory: an exclusive lock on RUN_DIR/.lock, holding the owner's host and pid;
opening a run directory (created, locked by process 0) and noting config changes on resume.

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

import jax
import numpy as np

from boost_jax.errors import ConfigError, RunDirBusy


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
            raise RunDirBusy(
                f"config field `run_dir`: {self.path.parent} is in use by a trainer on {who}; "
                "wait for it, stop it, or choose another run_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(
            fd,
            json.dumps(
                {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
            ).encode(),
        )
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


def open_run_dir(path: str, main_process: bool):
    """Create the run directory (the config's `run_dir`), take its lock (process 0 holds it for the
    whole run) and check the paths the run writes there (check_write_paths). One-line errors."""
    run_dir = Path(path).expanduser().resolve()
    lock, failed = RunLock(run_dir), None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if main_process:
            lock.acquire()
            check_write_paths(run_dir)
    except (RunDirBusy, ConfigError) as e:
        failed = e
    except OSError as e:
        raise ConfigError(
            f"config field `run_dir`: cannot write to {run_dir} ({e.strerror or e}); choose a writable directory"
        ) from e
    if failed is not None:
        lock.release()
    if jax.process_count() > 1:  # every process learns whether process 0 got the lock and the paths are fine
        from jax.experimental import multihost_utils

        if not np.all(multihost_utils.process_allgather(np.int32(failed is None))):
            raise failed or RunDirBusy(f"config field `run_dir`: {run_dir} cannot be used (see process 0's error)")
    elif failed:
        raise failed
    return run_dir, lock


# What a run writes under its run_dir: (name, whether it is a directory, what the run keeps there).
WRITTEN = (
    ("checkpoints", True, "its checkpoints"),
    ("tensorboard", True, "its TensorBoard events"),
    ("token_cache", True, "the tokenised text inputs"),
    ("metrics.jsonl", False, "its metrics"),
    ("config.json", False, "its config"),
)


def check_write_paths(run_dir: Path) -> None:
    """Every path the run will write under `run_dir` is of the kind it writes (a directory or a file)
    and writable, before anything compiles: one ConfigError naming each path in the way and the fix.
    (run_dir itself is writable: its lock file was just written.)"""
    problems = []
    for name, is_dir, holds in WRITTEN:
        path = run_dir / name
        if not os.path.lexists(path):
            continue  # created by the run, in run_dir
        if is_dir != path.is_dir():
            kind = "a directory, not a file" if path.is_dir() else "a file, not a directory"
            problems.append(f"{path} is {kind} (the run writes {holds} there)")
        elif not os.access(path, os.W_OK | (os.X_OK if is_dir else 0)):
            problems.append(f"{path} is not writable (the run writes {holds} there)")
    if problems:
        raise ConfigError(
            f"config field `run_dir`: {'; '.join(problems)}; move {'them' if len(problems) > 1 else 'it'} "
            "aside (or make it writable), or choose another run_dir"
        )


# Settings of one invocation, not of the run: changing them on resume is not worth a note.
PER_INVOCATION = (
    "restore_from",
    "train.stop_at_step",
    "train.progress",
    "distributed.",
    "compile_cache",
    "profile_steps",
    "xla_gpu_flags",
)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def note_config_change(run_dir: Path, cfg, step: int) -> None:
    """Resuming with changed settings is allowed, but said aloud; the previous config.json is kept."""
    path = run_dir / "config.json"
    try:
        old = _flat(json.loads(path.read_text()))
    except (OSError, ValueError):
        return
    new = _flat(json.loads(cfg.to_json_best_effort()))
    changed = [
        f"{k}: {old.get(k)!r} -> {v!r}" for k, v in new.items() if old.get(k) != v and not k.startswith(PER_INVOCATION)
    ]
    if changed:
        keep = path.with_name(f"config.before_step{step}.json")
        path.rename(keep)
        print(
            f"note: resuming with a changed config ({'; '.join(changed[:6])}{' ...' if len(changed) > 6 else ''}); "
            f"the previous config.json is kept as {keep.name}"
        )
