"""data.batching stream | packed | document: padding, loader time and training tokens/s; and what
document masks cost the chunked attention's compiled train step in memory.

    python benchmarks/batching.py [--seq 256,1024] [--steps 12] [--modes stream,packed,document]
        [--json benchmarks/batching.json]
    python benchmarks/batching.py --smoke   # 500 documents, seq 64, 2 steps, a 1-layer model: checks the command

Corpus: 20,000 generated documents of random bytes whose lengths follow C4's shape under the T5
tokenizer (log-normal, median ~250 tokens, long tail; clipped to [16, 8192]), prepared with the byte
tokenizer by `boost_jax.data.prepare` (so one byte is one token). For each seq_len and mode, the tiny
default model trains `--steps` steps at global batch 16 on this machine; the table gives the pad
fraction (row slots holding no token), the loader's time per global batch and the tokens/s of the
last logging window (tokens that are not padding, as the trainer reports them). Then the compiled
train step of a cola_7b-shaped layer (one layer, one device, seq 4096, batch 1, attention=chunked)
with stream rows vs packed rows: temp memory from XLA's memory analysis (segment ids must not bring
back an O(T^2) array). Prints Markdown tables, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def corpus(root: Path, docs: int = 20_000, seed: int = 0) -> Path:
    from boost_jax.data.prepare import prepare

    out = root / "prepared"
    if (out / "index.json").exists():
        return out
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(250), 0.9, docs), 16, 8192).astype(int)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", np.uint8)
    with open(root / "docs.jsonl", "w") as f:
        for n in lengths:
            f.write(json.dumps({"text": rng.choice(letters, n).tobytes().decode()}) + "\n")
    prepare([str(root / "docs.jsonl")], out, "byte", progress=False)
    return out


def config(data: Path, mode: str, seq: int, steps: int, run_dir: Path, smoke: bool = False):
    from boost_jax.config import base_config

    c = base_config()
    if smoke:
        c.model.update(n_layers=1)
    c.run_dir = str(run_dir)
    c.data.update(source="tokens", path=str(data), token_dtype="uint16", batching=mode)
    c.model.max_seq_len = max(c.model.max_seq_len, seq)
    c.train.update(
        seq_len=seq,
        global_batch=16,
        steps=steps,
        warmup_steps=1,
        log_every=max(steps // 2, 1),
        eval_every=0,
        progress=False,
    )
    c.checkpoint.update(every=steps, async_save=False)
    return c


MODES = ("stream", "packed", "document")


def throughput(data: Path, seq: int, steps: int, tmp: Path, smoke: bool = False, modes=MODES) -> list[dict]:
    from boost_jax import train
    from boost_jax.data import build_loaders

    rows = []
    for mode in modes:
        cfg = config(data, mode, seq, steps, tmp / f"run_{mode}_{seq}", smoke)
        t0 = time.perf_counter()
        loader = build_loaders(cfg)[0]
        start = time.perf_counter() - t0
        t0 = time.perf_counter()
        batches = [loader.batch(i * 16) for i in range(20)]
        per_batch = (time.perf_counter() - t0) / 20
        if mode == "stream":
            pad = 0.0
        else:
            real = sum(
                int((b["segments"][:, :-1] > 0).sum()) if "segments" in b else int(b["lengths"].sum()) for b in batches
            )
            pad = 1.0 - real / (20 * 16 * seq)
        train.run(cfg)
        logged = [json.loads(line) for line in open(Path(cfg.run_dir) / "metrics.jsonl")]
        last = [r for r in logged if "tokens_per_s" in r][-1]
        rows.append(
            {
                "seq_len": seq,
                "batching": mode,
                "rows_per_epoch": loader.n,
                "pad_fraction": pad,
                "loader_start_s": start,
                "loader_s_per_batch": per_batch,
                "tokens_per_s": last["tokens_per_s"],
                "logged_pad_fraction": last.get("pad_fraction", 0.0),
            }
        )
        print(f"  seq {seq} {mode}: pad {pad:.3f}, {last['tokens_per_s']:,.0f} tokens/s", file=sys.stderr)
    return rows


def memory(seq: int = 4096, size: str = "7b") -> list[dict]:
    """Compiled train-step temp memory, cola_<size> layer shape, chunked attention, stream vs packed rows."""
    import jax

    from boost_jax.config import sized_config
    from boost_jax.runtime.build import build

    out = []
    for mode in ("stream", "packed"):
        c = sized_config(size, "cola")
        c.data.update(source="embedded", batching=mode)
        c.model.update(n_layers=1, attention="chunked", dtype="bfloat16")
        c.train.update(seq_len=seq, global_batch=1, grad_accum=1)
        c.parallel.update(num_devices=1, data=1)
        built = build(c, jax.devices()[:1])
        mem = built.lower_train().compile().memory_analysis()
        out.append(
            {
                "batching": mode,
                "seq_len": seq,
                "temp_bytes": int(mem.temp_size_in_bytes),
                "score_matrix_f32_bytes": 4 * seq * seq * c.model.n_heads,
            }
        )
        print(f"  memory {mode}: temp {mem.temp_size_in_bytes / 2**30:.3f} GiB", file=sys.stderr)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", default="256,1024")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "batching.json"))
    ap.add_argument("--modes", default=",".join(MODES), help="data.batching modes to train with")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="500 documents, seq 64, 2 steps, 1 layer; the memory "
        "table at cola_60m widths, seq 256 (JSON to the temp directory unless --json)",
    )
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        ap.error(f"--modes: unknown {sorted(set(modes) - set(MODES))}; choose from {','.join(MODES)}")
    if args.smoke:
        args.seq = "64" if args.seq == ap.get_default("seq") else args.seq
        args.steps = 2 if args.steps == ap.get_default("steps") else args.steps
        if args.json == ap.get_default("json"):
            args.json = str(Path(tempfile.gettempdir()) / "batching_smoke.json")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = corpus(tmp, 500 if args.smoke else 20_000)
        rows = [
            r
            for seq in map(int, args.seq.split(","))
            for r in throughput(data, seq, args.steps, tmp, args.smoke, modes)
        ]
    mem = [] if args.no_memory else memory(256, "60m") if args.smoke else memory()
    print("| seq | batching | rows/epoch | pad fraction | loader s/batch | tokens/s (not padding) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['seq_len']} | {r['batching']} | {r['rows_per_epoch']:,} | {r['pad_fraction']:.3f} | "
            f"{r['loader_s_per_batch'] * 1e3:.1f} ms | {r['tokens_per_s']:,.0f} |"
        )
    if mem:
        print(
            f"\n| {'cola_60m' if args.smoke else 'cola_7b'} layer, seq {mem[0]['seq_len']}, chunked | temp memory "
            "| one f32 [H, T, T] score tensor |"
        )
        print("|---|---|---|")
        for m in mem:
            print(
                f"| {m['batching']} | {m['temp_bytes'] / 2**30:.3f} GiB | {m['score_matrix_f32_bytes'] / 2**30:.1f} GiB |"  # noqa: E501
            )
    Path(args.json).write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "smoke": args.smoke,
                "machine": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "rows": rows,
                "memory": mem,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
