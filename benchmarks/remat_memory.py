"""Activation-checkpointing policies: compiled peak memory and recompute FLOPs (no wall time).

    python benchmarks/remat_memory.py [--config configs/cola_1b.py] [--seq 2048] [--batch 8]
        [--policies none,full,dots,lowrank]

For each `remat.policy` it compiles the real train step of one device (abstract shapes: nothing is
allocated) and reads XLA's `memory_analysis()`: activation memory = the temp buffers (arguments and
outputs, i.e. params, optimizer state and the batch, are the same for every policy). Recompute FLOPs
come from `cost_analysis()` of the step unrolled at one and at two layers (XLA counts a loop body
once): their difference is one layer, the rest is embedding, head and optimizer, and the full-depth
step is rest + L x layer. The overhead is that step's FLOPs over the `none` policy's. Prints a Markdown table, writes
JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

from boost_jax.config import load_config_file
from boost_jax.runtime.build import build

POLICIES = ("none", "full", "dots", "lowrank")


def compiled_step(cfg):
    return build(cfg, jax.devices()[:1]).lower_train().compile()


def measure(base, policy):
    cfg = base.copy_and_resolve_references()
    cfg.remat.policy = policy
    t0 = time.perf_counter()
    mem = compiled_step(cfg).memory_analysis()
    flops = []
    for layers in (1, 2):
        unrolled = cfg.copy_and_resolve_references()
        unrolled.model.update(n_layers=layers, scan_unroll=True)
        flops.append(compiled_step(unrolled).cost_analysis()["flops"])
    per_layer = flops[1] - flops[0]
    return {
        "policy": policy,
        "temp_bytes": mem.temp_size_in_bytes,
        "argument_bytes": mem.argument_size_in_bytes,
        "output_bytes": mem.output_size_in_bytes,
        "layer_flops": per_layer,
        "step_flops": flops[0] - per_layer + cfg.model.n_layers * per_layer,
        "compile_s": time.perf_counter() - t0,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "cola_1b.py"))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8, help="sequences per device")
    ap.add_argument("--dtype", default="bfloat16")
    # The table is the materialised-attention, full-logits step; --attention chunked --loss_chunk 512
    # measures today's long-sequence defaults.
    ap.add_argument("--attention", default="xla", help="model.attention")
    ap.add_argument("--loss_chunk", type=int, default=0, help="model.loss_chunk")
    ap.add_argument("--policies", default=",".join(POLICIES), help="remat.policy values, none first (the baseline)")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "remat_memory.json"))
    args = ap.parse_args(argv)
    cfg = load_config_file(args.config)
    cfg.train.update(seq_len=args.seq, global_batch=args.batch, grad_accum=1)
    cfg.model.update(
        dtype=args.dtype,
        max_seq_len=max(cfg.model.max_seq_len, args.seq),
        attention=args.attention,
        loss_chunk=args.loss_chunk,
    )
    cfg.parallel.update(data=1, fsdp=1, tensor=1, num_devices=1)
    cfg.data.source = "embedded"  # nothing is read: the step is compiled from abstract shapes
    cfg.data.batching = "stream"  # model costs as before documents (benchmarks/batching.py measures those)
    policies = args.policies.split(",")
    if policies[0] != "none":
        ap.error(f"--policies: start with none, the baseline the others are compared with (got {args.policies})")
    rows = [measure(cfg, p) for p in policies]
    none = rows[0]
    print(
        f"{cfg.name}, seq {args.seq}, batch {args.batch}/device, {args.dtype}, one device "
        f"({jax.devices()[0].platform} compiler's memory_analysis; compiled, not run)\n"
    )
    print("| policy | activation (temp) GiB | vs none | recompute FLOPs / step FLOPs |")
    print("|---|---|---|---|")
    for r in rows:
        r["activation_vs_none"] = r["temp_bytes"] / none["temp_bytes"]
        r["recompute_overhead"] = (r["step_flops"] - none["step_flops"]) / none["step_flops"]
        print(
            f"| {r['policy']} | {r['temp_bytes'] / 2**30:.2f} | {100 * r['activation_vs_none']:.0f}% | "
            f"{100 * r['recompute_overhead']:.1f}% |"
        )
    with open(args.json, "w") as f:
        json.dump(
            {
                "config": cfg.name,
                "seq": args.seq,
                "batch_per_device": args.batch,
                "dtype": args.dtype,
                "backend": jax.default_backend(),
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
