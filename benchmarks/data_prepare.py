"""Throughput of `python -m boost_jax.data.prepare`: MB/s of JSONL per worker process.

    python benchmarks/data_prepare.py [--mb 64] [--workers 1,2] [--tokenizer byte] [--unit-mb 8]

Writes a C4-like JSONL file (one {"text", "timestamp", "url"} object per line, documents of a few
hundred to a few thousand bytes of words, some non-ASCII) of --mb MB to a temporary directory, then
tokenises it with each worker count (fresh output each time, spawned worker processes, no progress
bar) and reports the wall time of the whole call (process start-up included), MB/s in total and per
worker, tokens/s, and MB per CPU-second of all processes (the parent and its workers): on a shared
machine other jobs compete for the same cores, so wall-clock scaling with workers is bounded by the
free cores (the load average before each run is printed), while MB per CPU-second is what one worker
does with a core of its own. Prints a Markdown table, writes JSON (benchmarks/data_prepare.json).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from boost_jax.data.prepare import prepare

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "data model training token corpus naïve café über straße 训练 数据 модель"
).split()


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    target, written = int(megabytes * (1 << 20)), 0
    with open(path, "w", encoding="utf-8") as f:
        i = 0
        while written < target:
            n = int(np.clip(rng.lognormal(5.5, 0.8), 20, 4000))  # words per document
            text = " ".join(rng.choice(WORDS, n)) + "."
            line = (
                json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.org/{i}"})
                + "\n"
            )
            f.write(line)
            written += len(line.encode("utf-8"))
            i += 1
    return written


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the worker processes)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


PEAK_RSS = """
import resource, sys
from boost_jax.data.prepare import prepare
prepare([sys.argv[1]], sys.argv[2], sys.argv[3], workers=0, unit_bytes=int(sys.argv[4]), progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def peak_rss_mb(corpus: Path, out: Path, tokenizer: str, unit_bytes: int) -> float:
    """Peak resident memory (MB) of a fresh process that tokenises `corpus` by itself (workers=0)."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, str(corpus), str(out), tokenizer, str(unit_bytes)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return int(done.stdout.split()[-1]) / 1024  # ru_maxrss is in KiB on Linux


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=64.0, help="JSONL size in MB")
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    ap.add_argument("--tokenizer", default="byte")
    ap.add_argument("--unit-mb", type=float, default=8.0, help="work unit size (several units per worker)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("data_prepare.json")))
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="data_prepare_"))
    try:
        corpus = tmp / "corpus.jsonl"
        size = write_corpus(corpus, args.mb)
        rows = []
        for workers in [int(w) for w in args.workers.split(",")]:
            load = os.getloadavg()[0]
            out = tmp / f"out_{workers}"
            cpu0 = _cpu_seconds()
            t0 = time.perf_counter()
            index = prepare(
                [str(corpus)],
                out,
                args.tokenizer,
                workers=workers,
                unit_bytes=int(args.unit_mb * (1 << 20)),
                progress=False,
            )
            seconds = time.perf_counter() - t0
            cpu = _cpu_seconds() - cpu0
            mb_s = size / (1 << 20) / seconds
            rows.append(
                {
                    "workers": workers,
                    "seconds": round(seconds, 3),
                    "mb_per_s": round(mb_s, 2),
                    "mb_per_s_per_worker": round(mb_s / workers, 2),
                    "mb_per_cpu_s": round(size / (1 << 20) / cpu, 2),
                    "cpu_seconds": round(cpu, 3),
                    "tokens_per_s": round(index["tokens"] / seconds),
                    "tokens": index["tokens"],
                    "documents": index["documents"],
                    "shards": len(index["shards"]),
                    "load_average_before": round(load, 2),
                }
            )
            shutil.rmtree(out)
        # Memory does not grow with the input: one process, the whole file vs its first quarter.
        small = tmp / "small.jsonl"
        write_corpus(small, args.mb / 4)
        unit = int(args.unit_mb * (1 << 20))
        memory = {
            f"{path.stat().st_size / (1 << 20):.3g} MB": round(
                peak_rss_mb(path, tmp / f"rss_{path.stem}", args.tokenizer, unit), 1
            )
            for path in (small, corpus)
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(
        f"JSONL {size / (1 << 20):.1f} MB, tokenizer {args.tokenizer}, {os.cpu_count()} cores "
        f"(shared with other jobs: see the load average)\n"
    )
    print("| workers | wall s | MB/s | MB/s per worker | MB per CPU-second | tokens/s | load avg before |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['workers']} | {r['seconds']:.2f} | {r['mb_per_s']:.1f} | {r['mb_per_s_per_worker']:.1f} | "
            f"{r['mb_per_cpu_s']:.1f} | {r['tokens_per_s']:,} | {r['load_average_before']:.2f} |"
        )
    print(
        "\npeak RSS of one tokenising process (workers=0), by JSONL size: "
        + ", ".join(f"{k}: {v:.0f} MB" for k, v in memory.items())
    )
    result = {
        "peak_rss_mb_by_input": memory,
        "jsonl_bytes": size,
        "tokenizer": args.tokenizer,
        "unit_mb": args.unit_mb,
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "python": sys.version.split()[0],
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
