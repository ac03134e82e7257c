"""Loader start-up cost by corpus size and data.shuffle: build time, first batches, peak memory.

    python benchmarks/loader_start.py [--tokens 1e9,1e10,2e11] [--shuffle feistel,numpy]
        [--json benchmarks/loader_start.json] [--dir /tmp/boost_jax_loader_start]

For each corpus size, writes (once; later runs reuse it) a prepared corpus of sparse files under --dir:
the `python -m boost_jax.data.prepare` layout (index.json, plan.json, uint16 shards of up to 2^34 byte
tokens) whose shards are `truncate`d to size, so they take no disk and read as zeros. Then, for each
data.shuffle, a fresh Python process (so that ru_maxrss is this measurement's peak) times
`build_loaders(cfg)` (train.seq_len 256, train.global_batch 512), the first batch of epoch 0
(`batch(0)`) and of epoch 1 (`batch(n)`, n = samples per epoch), and reports its peak RSS and the RSS
after the imports; "order s" is the part of both batches' time spent in the permutation alone
(`loader.units`, called before each batch). A materialised numpy permutation holds 8 bytes per
window (seq_len + 1 tokens) and two epochs' permutations briefly coexist: 2e11 tokens (~740M windows)
need ~12 GiB and ~2 minutes with data.shuffle=numpy. The reads go through np.memmap: each first
touch of a page faults and the kernel reads ahead around it (the block device's read_ahead_kb), so
a batch's read time depends on the machine and on what an earlier run left in the page cache.
Prints a Markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

SHARD_TOKENS = 1 << 34
SEQ_LEN, GLOBAL_BATCH = 256, 512


def rss_gib() -> float:
    """This process's peak resident set so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


def sparse_corpus(root: Path, tokens: int) -> Path:
    """A prepared directory of `tokens` zero uint16 tokens in sparse shards (reused if already there)."""
    from boost_jax.data.sources import FORMAT, INDEX
    from boost_jax.data.tokenizer import tokenizer_id

    out = root / f"tokens_{tokens}"
    sizes = [min(SHARD_TOKENS, tokens - lo) for lo in range(0, tokens, SHARD_TOKENS)]
    shards = [{"file": f"shard_{i:05d}.bin", "documents": 1, "tokens": n, "bytes": n} for i, n in enumerate(sizes)]
    index = {
        "format": FORMAT,
        "tokenizer": "byte",
        "tokenizer_id": tokenizer_id("byte"),
        "vocab_size": 256,
        "eos_id": None,
        "dtype": "uint16",
        "field": "text",
        "documents": len(shards),
        "tokens": tokens,
        "bytes": tokens,
        "shards": shards,
    }
    if (
        (out / INDEX).exists()
        and json.loads((out / INDEX).read_text()) == index
        and all((out / s["file"]).stat().st_size == 2 * s["tokens"] for s in shards if (out / s["file"]).exists())
    ):
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX).unlink(missing_ok=True)
    (out / "plan.json").write_text(
        json.dumps(
            {
                "format": FORMAT,
                "tokenizer": "byte",
                "dtype": "uint16",
                "benchmark": "sparse zero shards (benchmarks/loader_start.py)",
            }
        )
    )
    for s in shards:
        with open(out / s["file"], "wb") as f:
            f.truncate(2 * s["tokens"])
    (out / INDEX).write_text(json.dumps(index, indent=1))
    return out


def measure(path: str, shuffle: str) -> dict:
    """Run in a fresh process: the times and memory of one loader start."""
    t0 = time.perf_counter()
    from boost_jax.config import base_config, check_fields
    from boost_jax.data import build_loaders

    cfg = base_config()
    cfg.data.update(source="tokens", path=path, token_dtype="uint16", tokenizer="byte", shuffle=shuffle)
    cfg.train.update(seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH)
    cfg.model.update(vocab_size=256, max_seq_len=SEQ_LEN)
    check_fields(cfg)
    row = {"import_s": time.perf_counter() - t0, "import_rss_gib": rss_gib()}
    t = time.perf_counter()
    train, _, _ = build_loaders(cfg)
    row["build_s"] = time.perf_counter() - t
    n = getattr(train, "n", None)  # samples per epoch (a TokenLoader's; a mixture has none)
    row.update(samples_per_epoch=n, order_s=None, epoch1_batch_s=None)
    units = getattr(train, "units", None)  # sample -> unit: the permutation alone, without the reads
    for key, position in (("first_batch_s", 0), ("epoch1_batch_s", n)):
        if position is None:
            continue
        t = time.perf_counter()
        if units is not None:
            units(range(position, position + GLOBAL_BATCH))  # builds (numpy) or keys (feistel) the order
            row["order_s"] = (row["order_s"] or 0.0) + time.perf_counter() - t
        batch = train.batch(position)  # the order is cached: this adds the reads
        row[key] = time.perf_counter() - t
        assert batch.shape == (GLOBAL_BATCH, SEQ_LEN + 1), batch.shape
    row["total_s"] = row["build_s"] + row["first_batch_s"] + (row["epoch1_batch_s"] or 0.0)
    row["peak_rss_gib"] = rss_gib()
    return row


def run(path: Path, tokens: int, shuffle: str) -> dict:
    """`measure` in a child process (its own peak RSS); an error becomes the row's `error`."""
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(path), shuffle],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    row = {"tokens": tokens, "shuffle": shuffle, "process_s": time.perf_counter() - t}
    if proc.returncode:
        row["error"] = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        print(proc.stderr, file=sys.stderr)
    else:
        row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return row


def table(rows: list[dict]) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [
        "| tokens | windows | shuffle | build s | first batch s | epoch-1 batch s | of which order s | total s "
        "| RSS after import GiB | peak RSS GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tokens']:.0e} | - | {r['shuffle']} | error: {r['error']} | | | | | | |")
            continue
        lines.append(
            f"| {r['tokens']:.0e} | {f(r['samples_per_epoch'], ',')} | {r['shuffle']} | {r['build_s']:.3f} "
            f"| {r['first_batch_s']:.3f} | {f(r['epoch1_batch_s'], '.3f')} | {f(r['order_s'], '.3f')} "
            f"| {r['total_s']:.3f} | {r['import_rss_gib']:.2f} | {r['peak_rss_gib']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1e9,1e10,2e11", help="corpus sizes in tokens, comma-separated")
    ap.add_argument("--shuffle", default="feistel,numpy", help="data.shuffle settings, comma-separated")
    ap.add_argument("--json", default=str(Path(__file__).with_suffix(".json")))
    ap.add_argument("--dir", default="/tmp/boost_jax_loader_start", help="where the sparse corpora are kept")
    ap.add_argument("--child", nargs=2, metavar=("PATH", "SHUFFLE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(*args.child)))
        return []
    rows = []
    for tokens in [int(float(t)) for t in args.tokens.split(",")]:
        path = sparse_corpus(Path(args.dir), tokens)
        for shuffle in args.shuffle.split(","):
            rows.append(run(path, tokens, shuffle))
            print(f"{tokens:.0e} tokens, {shuffle}: {rows[-1].get('total_s', rows[-1].get('error'))}", file=sys.stderr)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "seq_len": SEQ_LEN,
                    "global_batch": GLOBAL_BATCH,
                    "shard_tokens": SHARD_TOKENS,
                    "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )
    return rows


if __name__ == "__main__":
    main()
