"""The README's first command as a user meets it: `python -m boost_jax.train` in a fresh directory (no
compile cache), timed like `/usr/bin/time` (wall clock, and the CPU time of the process from its
resource usage), with the first step's time (the trainer's own line: it waits for the compile), the
time left the progress bar showed at the first log point against the time the rest took, and the machine's
load average sampled through the run (wall time on a shared machine grows with it). Prints a table,
writes JSON.

    python benchmarks/first_command.py [--json benchmarks/first_command.json] [-- TRAIN FLAGS...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BAR = re.compile(r"\|\s*(\d+)/(\d+) \[([\d:]+)<([\d:?]+)")  # tqdm: "| 2/400 [00:01<05:12, ..."


def seconds(clock: str) -> float | None:
    """tqdm's [H:]MM:SS as seconds (None for '?')."""
    if "?" in clock:
        return None
    total = 0.0
    for part in clock.split(":"):
        total = total * 60 + float(part)
    return total


def measure(flags: list[str], workdir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a user's first run compiles everything
    loads, done = [], threading.Event()

    def sample():
        while not done.wait(5.0):
            loads.append(os.getloadavg()[0])

    segments = []  # (time since start, text) of every stderr line or bar redraw

    def read(stream):
        buf = ""
        while True:
            chunk = stream.read(1)
            if not chunk:
                break
            if chunk in "\r\n":
                if buf.strip():
                    segments.append((time.perf_counter() - start, buf))
                buf = ""
            else:
                buf += chunk

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    loads.append(os.getloadavg()[0])
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "boost_jax.train", *flags],
        cwd=workdir,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    threading.Thread(target=sample, daemon=True).start()
    reader = threading.Thread(target=read, args=(proc.stderr,), daemon=True)
    reader.start()
    out = proc.stdout.read()
    proc.wait()
    wall = time.perf_counter() - start
    reader.join()
    done.set()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(
            f"python -m boost_jax.train {' '.join(flags)} failed ({proc.returncode}):\n"
            + "\n".join(text for _, text in segments[-20:])
        )
    first = re.search(r"step (\d+) took ([\d.]+) s with the compile", out)
    # The bar at the first log point (its postfix shows the loss): the steps before it have finished
    # there (the loop reads their metrics back), while between log points it counts steps dispatched.
    bars = [(t, *BAR.search(text).groups()) for t, text in segments if BAR.search(text) and "loss=" in text]
    after_compile = [b for b in bars if int(b[1]) >= 2]
    last = max((t for t, text in segments if BAR.search(text)), default=None)
    row = {
        "command": " ".join(["python -m boost_jax.train", *flags]),
        "wall_s": round(wall, 1),
        "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 1),
        "first_step_s": float(first.group(2)) if first else None,
        "load_avg": {"min": min(loads), "mean": round(sum(loads) / len(loads), 2), "max": max(loads)},
        "cpus": os.cpu_count(),
    }
    if after_compile and last is not None:
        t, n, total, _, left = after_compile[0]
        row["bar_at_first_log"] = {
            "step": int(n),
            "of": int(total),
            "time_left_shown_s": seconds(left),
            "time_the_rest_took_s": round(last - t, 1),
        }
    return row


def fmt(s: float | None) -> str:
    return "-" if s is None else f"{int(s // 60)} min {s % 60:.0f} s" if s >= 60 else f"{s:.1f} s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("flags", nargs="*", help="after --: flags for the trainer (default: none, the README's command)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        row = measure(args.flags, Path(workdir))
    bar = row.get("bar_at_first_log", {})
    print(
        "| command | wall | CPU | first step (with the compile) | time left shown at the first log | the rest took | "
        "load average (min / mean / max) |\n|---|---|---|---|---|---|---|"
    )
    print(
        f"| `{row['command']}` | {fmt(row['wall_s'])} | {fmt(row['cpu_s'])} | {fmt(row['first_step_s'])} | "
        f"{fmt(bar.get('time_left_shown_s'))} | {fmt(bar.get('time_the_rest_took_s'))} | "
        f"{row['load_avg']['min']:.1f} / {row['load_avg']['mean']:.1f} / {row['load_avg']['max']:.1f} "
        f"({row['cpus']} CPUs) |"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
