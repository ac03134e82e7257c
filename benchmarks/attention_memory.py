"""Compiled memory of a 7B train step against sequence length, per attention implementation.

    python benchmarks/attention_memory.py [--configs cola_7b,llama_7b] [--seqs 4096,8192,16384]
        [--attention xla,chunked] [--tensor 4] [--remat none] [--devices 4]

For each (config, seq, attention) it compiles the real train step on `--devices` emulated CPU
devices with tensor parallelism `--tensor` (btp; micro-batch 1 sequence, bf16) from abstract shapes
(nothing is allocated) and reads XLA's `memory_analysis()` per device: temp buffers (activations and
working set) and the total with arguments (parameters, optimizer state, batch). With `xla` the
float32 scores [heads, T, S] of every layer are kept for the backward (quadratic in T); `chunked`
keeps only the output and log-sum-exp (linear). Prints a Markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

from boost_jax.config import load_config_file  # noqa: E402
from boost_jax.tools.comm_report.programs import compile_program  # noqa: E402
from boost_jax.validate import validate  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")
GIB = 2**30


def measure(name: str, seq: int, attention: str, tensor: int, devices: int, remat: str) -> dict:
    cfg = load_config_file(os.path.join(ROOT, "configs", f"{name}.py"))
    cfg.model.update(dtype="bfloat16", attention=attention, max_seq_len=max(cfg.model.max_seq_len, seq))
    cfg.train.update(seq_len=seq, global_batch=devices // tensor, grad_accum=1)
    cfg.parallel.update(data=devices // tensor, fsdp=1, tensor=tensor, num_devices=devices, strategy="btp")
    cfg.remat.policy = remat
    cfg.data.source = "embedded"
    cfg.data.batching = "stream"  # model costs as before documents (benchmarks/batching.py measures those)
    validate(cfg)
    start = time.perf_counter()
    compiled, _, _ = compile_program(cfg, "train_step", jax.devices()[:devices], cfg.model.n_layers, False)
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return {
        "config": name,
        "seq": seq,
        "attention": attention,
        "temp_gib": m.temp_size_in_bytes / GIB,
        "total_gib": total / GIB,
        "compile_s": time.perf_counter() - start,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="cola_7b,llama_7b")
    ap.add_argument("--seqs", default="4096,8192,16384")
    ap.add_argument("--attention", default="xla,chunked")
    ap.add_argument("--tensor", type=int, default=4)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--remat", default="none")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "attention_memory.json"))
    args = ap.parse_args(argv)
    seqs = [int(s) for s in args.seqs.split(",")]
    rows = []
    for name in args.configs.split(","):
        for attention in args.attention.split(","):
            for seq in seqs:
                rows.append(measure(name, seq, attention, args.tensor, args.devices, args.remat))
                print(
                    f"  {name} seq {seq} {attention}: temp {rows[-1]['temp_gib']:.2f} GiB "
                    f"({rows[-1]['compile_s']:.0f} s to compile)",
                    file=sys.stderr,
                )
    print(
        f"btp tensor {args.tensor} on {args.devices} devices, micro-batch 1 per data replica, bf16, remat "
        f"{args.remat}; per device, XLA CPU memory_analysis (compiled, not run); {jax.__version__}\n"
    )
    print(
        "| config | attention | " + " | ".join(f"temp GiB @ {s}" for s in seqs) + f" | growth {seqs[0]}->{seqs[-1]} |"
    )
    print("|---|---|" + "---|" * (len(seqs) + 1))
    for name in args.configs.split(","):
        for attention in args.attention.split(","):
            temps = [r["temp_gib"] for r in rows if r["config"] == name and r["attention"] == attention]
            print(
                f"| {name} | {attention} | "
                + " | ".join(f"{t:.2f}" for t in temps)
                + f" | {temps[-1] / temps[0]:.2f}x |"
            )
    with open(args.json, "w") as f:
        json.dump(
            {"tensor": args.tensor, "devices": args.devices, "remat": args.remat, "jax": jax.__version__, "rows": rows},
            f,
            indent=2,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
