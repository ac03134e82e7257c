"""Gradient all-reduce over `data` executed per optimizer step, for grad_accum 1 and 4.

    python benchmarks/grad_reduce.py [--config configs/cola_1b.py] [--data 8] [--seq 256]
    python benchmarks/grad_reduce.py --pipeline

`--pipeline`: a tiny GPipe step instead (configs/tiny.py widths with d_ff 256, 4 layers in 2 stages,
4 micro-batches, mesh pipeline 2 x data 2 x fsdp 2, seq 16, float32): data/fsdp reduction elements
executed per step (every all-reduce / reduce-scatter over data or fsdp, times its loops' trip
counts, loops as compiled) and the step's temp memory, for the placements of
`boost_jax/parallel/pipeline/stack.py`: once per pass over data x fsdp (the default), over data only
(fsdp per tick), and GSPMD's own (every tick). A second table: gpipe and circular (V = 2) at
grad_accum 1 and 4 (global batch 16 per accumulation micro-batch), the stage weights' gradient
reduced once per optimizer step (`pipeline.accumulate`, the default) against once per accumulation
micro-batch (the plain accumulation loop around `_replicas`' once-per-pass reduction: how the step
ran before). Writes grad_reduce_pipeline.json.

Compiles the real train step on `--data` emulated CPU devices (mesh data x 1 x 1, one sequence per
device per micro-batch, abstract shapes) and reads the optimised HLO: every all-reduce over `data`
counts its elements once, times the trip count (grad_accum) when it sits inside the accumulation
loop (the layer scan is unrolled, so that is the only loop). It does so with the once-per-step
reduction (`boost_jax/parallel/grad_reduce.py`) and with XLA's own placement (the plain
accumulation loop) for comparison. Prints a Markdown table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


from boost_jax.config import load_config_file  # noqa: E402
from boost_jax.parallel import grad_reduce  # noqa: E402
from boost_jax.tools.hlo_comm import parse_collectives  # noqa: E402
from boost_jax.validate import validate  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")


def executed(cfg_path, data: int, seq: int, accum: int, once: bool) -> dict:
    cfg = load_config_file(cfg_path)
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, seq)
    cfg.model.scan_unroll = True  # the accumulation scan is then the only loop: in-loop ops run grad_accum times
    cfg.train.update(seq_len=seq, global_batch=data * accum, grad_accum=accum)
    cfg.parallel.update(data=data, fsdp=1, tensor=1, num_devices=data)
    cfg.data.source = "embedded"
    cfg.data.batching = "stream"  # model costs as before documents (benchmarks/batching.py measures those)
    validate(cfg)
    applies = grad_reduce.island_applies
    if not once:
        grad_reduce.island_applies = lambda mesh, strategy: False
    try:
        compiled = _compile(cfg)
    finally:
        grad_reduce.island_applies = applies
    ops = [c for c in parse_collectives(compiled.as_text()) if c.kind == "all-reduce" and c.group_size == data]
    in_loop = sum(c.elements for c in ops if c.in_loop)
    outside = sum(c.elements for c in ops if not c.in_loop)
    return {
        "grad_accum": accum,
        "once_per_step": once,
        "in_loop_elements": in_loop,
        "outside_elements": outside,
        "executed_elements": in_loop * accum + outside,
    }


def _compile(cfg):
    from boost_jax.runtime.build import build

    return build(cfg).lower_train().compile()


PIPELINE_PLACEMENTS = {
    "once per pass, data x fsdp (pipeline.py)": None,
    "once per pass over data, fsdp per tick": ("data",),
    "every tick (GSPMD's own)": (),
}


def pipeline_executed(
    placement: str, stages: int = 2, data: int = 2, fsdp: int = 2, micro: int = 4, seq: int = 16
) -> dict:
    from boost_jax.parallel.pipeline import gspmd, stack

    cfg = load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
    cfg.model.update(n_layers=4, d_ff=256, dtype="float32")
    cfg.train.update(seq_len=seq, global_batch=data * fsdp * micro, grad_accum=1)
    cfg.parallel.update(
        pipeline=stages, data=data, fsdp=fsdp, tensor=1, num_devices=stages * data * fsdp, microbatches=micro
    )
    validate(cfg)
    axes = PIPELINE_PLACEMENTS[placement]
    patch = (
        None
        if axes is None
        else [
            (m, "once_per_pass_axes", lambda mesh, strategy: tuple(a for a in axes if mesh.shape[a] > 1))
            for m in (stack, gspmd)  # where the gpipe step reads it
        ]
    )
    compiled, ops = _data_fsdp_reductions(cfg, patch)
    return {
        "placement": placement,
        "in_loop_elements": sum(c.elements for c in ops if c.in_loop),
        "outside_elements": sum(c.elements for c in ops if not c.in_loop),
        "executed_elements": sum(c.elements * c.trips for c in ops),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
    }


def pipeline_accumulation(schedule: str, repeats: int, accum: int, per_step: bool) -> dict:
    """Executed data/fsdp reduction elements of the tiny pipelined step under grad_accum `accum`;
    per_step False: the stage gradient reduced once per accumulation micro-batch instead."""
    from boost_jax.parallel.pipeline import stack

    cfg = load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
    cfg.model.update(n_layers=4, d_ff=256, dtype="float32")
    cfg.train.update(seq_len=16, global_batch=16 * accum, grad_accum=accum)
    cfg.parallel.update(
        pipeline=2,
        data=2,
        fsdp=2,
        tensor=1,
        num_devices=8,
        microbatches=4,
        pipeline_schedule=schedule,
        pipeline_repeats=repeats,
    )
    validate(cfg)
    import jax

    plain = [
        (
            stack,
            "accumulate",
            lambda loss_fn, trained, batch, **_: grad_reduce.accumulate_grads(
                jax.value_and_grad(loss_fn), trained, batch
            ),
        )
    ]  # the plain loop: _replicas reduces per pass
    _, ops = _data_fsdp_reductions(cfg, None if per_step else plain)
    return {
        "schedule": schedule,
        "repeats": repeats,
        "grad_accum": accum,
        "once_per_optimizer_step": per_step,
        "executed_elements": sum(c.elements * c.trips for c in ops),
    }


def _data_fsdp_reductions(cfg, patch=None):
    """(compiled train step, its all-reduces and reduce-scatters over data or fsdp); `patch`: [(module,
    attribute, value)] swapped in while the step compiles."""
    defaults = [(module, name, getattr(module, name)) for module, name, _ in patch or []]
    for module, name, value in patch or []:
        setattr(module, name, value)
    try:
        compiled = _compile(cfg)
    finally:
        for module, name, default in defaults:
            setattr(module, name, default)
    return compiled, [
        c
        for c in parse_collectives(compiled.as_text(), _mesh(cfg))
        if c.kind in ("all-reduce", "reduce-scatter") and {"data", "fsdp"} & set(c.axes)
    ]


def _mesh(cfg):
    from boost_jax.parallel.mesh import make_mesh

    return make_mesh(cfg.parallel)


def pipeline_main(json_path: str) -> int:
    rows = [pipeline_executed(p) for p in PIPELINE_PLACEMENTS]
    print(
        "tiny (d 128, r 32, d_ff 256, 4 layers), GPipe 2 stages x 4 micro-batches, mesh pipeline=2 data=2 "
        "fsdp=2, seq 16, float32: data/fsdp reduction elements per step (XLA CPU, compiled, not run; "
        "in-loop ops x trip counts)\n"
    )
    print("| placement | in loop (static) | outside | executed per step | temp memory |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['placement']} | {r['in_loop_elements']:,} | {r['outside_elements']:,} | "
            f"{r['executed_elements']:,} | {r['temp_bytes'] / 1e6:.2f} MB |"
        )
    accumulation = [
        pipeline_accumulation(schedule, repeats, accum, per_step)
        for schedule, repeats in (("gpipe", 1), ("circular", 2))
        for accum in (1, 4)
        for per_step in (True, False)
    ]
    print("\nunder grad_accum (16 rows per accumulation micro-batch): data/fsdp reduction elements per step\n")
    print("| schedule | grad_accum | stage gradient once per optimizer step | once per accumulation micro-batch |")
    print("|---|---|---|---|")
    for i in range(0, len(accumulation), 2):
        a, b = accumulation[i], accumulation[i + 1]
        name = a["schedule"] + (f" V={a['repeats']}" if a["schedule"] == "circular" else "")
        print(f"| {name} | {a['grad_accum']} | {a['executed_elements']:,} | {b['executed_elements']:,} |")
    with open(json_path, "w") as f:
        json.dump(
            {
                "config": "tiny",
                "stages": 2,
                "data": 2,
                "fsdp": 2,
                "microbatches": 4,
                "seq": 16,
                "rows": rows,
                "accumulation": accumulation,
            },
            f,
            indent=2,
        )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", action="store_true", help="the GPipe step's reductions (see above)")
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "cola_1b.py"))
    ap.add_argument("--data", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "grad_reduce.json"))
    args = ap.parse_args(argv)
    if args.pipeline:
        return pipeline_main(args.json.replace("grad_reduce.json", "grad_reduce_pipeline.json"))
    rows = [executed(args.config, args.data, args.seq, accum, once) for once in (True, False) for accum in (1, 4)]
    name = os.path.splitext(os.path.basename(args.config))[0]
    print(
        f"{name}, mesh data={args.data}, seq {args.seq}, one sequence per device per micro-batch; all-reduce "
        f"elements over data per step (XLA CPU, compiled, not run; in-loop ops x grad_accum)\n"
    )
    print("| placement | grad_accum | in loop | outside | executed per step |")
    print("|---|---|---|---|---|")
    for r in rows:
        placement = "once per step (grad_reduce.py)" if r["once_per_step"] else "XLA's own (per micro-batch)"
        print(
            f"| {placement} | {r['grad_accum']} | {r['in_loop_elements']:,} | {r['outside_elements']:,} | "
            f"{r['executed_elements']:,} |"
        )
    with open(args.json, "w") as f:
        json.dump({"config": name, "data": args.data, "seq": args.seq, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
