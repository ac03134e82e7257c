"""Context parallelism at long sequences: compiled peak memory per device and the exchange per step.

    python benchmarks/context_memory.py [--models cola_7b,llama_7b] [--seqs 8192,32768,131072]
        [--contexts 1,2,4,8] [--layers 2] [--targets cpu,h100] [--json PATH] [--markdown PATH]

For each model, sequence length and C the real train step (the runtime's builder) is compiled from
abstract shapes, nothing allocated: one row of the sequence (global batch 1) split over C devices
(mesh context = C, nothing else split), bf16 compute, `model.attention=chunked`, remat none, the
zoo config's widths with `--layers` layers (compile-only; the per-layer activations scale with the
depth, the parameters with it too). Targets: `cpu` (XLA:CPU on emulated devices) and `h100` (the
deviceless GPU compile, boost_jax/tools/aot.py; needs the aot extra). Memory is
`compiled.memory_analysis()`: argument (parameters, optimizer state, batch) and temp (activations,
gradients, workspace) bytes per device. The exchange per step is `boost_jax.parallel.context.traffic`
(checked against compiled programs by tests/test_context.py) for ring and all_gather, full and
bottleneck K/V.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from boost_jax.tools.devices import emulate_cpu_devices  # noqa: E402

MODES = [("ring", "full"), ("ring", "bottleneck"), ("all_gather", "full"), ("all_gather", "bottleneck")]


def config(model: str, seq: int, c: int, layers: int):
    from boost_jax.config import sized_config

    family, size = model.split("_")
    cfg = sized_config(size, "dense" if family == "llama" else "cola")
    cfg.model.update(
        n_layers=layers, max_seq_len=max(seq, cfg.model.max_seq_len), dtype="bfloat16", attention="chunked"
    )
    cfg.train.update(seq_len=seq, global_batch=1, grad_accum=1)
    cfg.remat.policy = "none"
    cfg.data.update(source="embedded", batching="stream")
    cfg.parallel.update(data=1, fsdp=1, tensor=1, pipeline=1, context=c, num_devices=c)
    return cfg


def measure(cfg, target: str) -> dict:
    import jax

    from boost_jax.runtime.build import build

    if target == "cpu":
        devices = jax.devices("cpu")[: cfg.parallel.context]
    else:
        from boost_jax.tools import aot

        devices = aot.devices(target, cfg.parallel.context)
    t0 = time.perf_counter()
    m = build(cfg, devices).lower_train().compile().memory_analysis()
    return {
        "argument_bytes": m.argument_size_in_bytes,
        "temp_bytes": m.temp_size_in_bytes,
        "output_bytes": m.output_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes,
        "peak_bytes": m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes,
        "compile_s": round(time.perf_counter() - t0, 1),
    }


def exchange(cfg) -> dict:
    from boost_jax.parallel.context import traffic

    out = {}
    for attention, kv in MODES:
        if kv == "bottleneck" and cfg.model.linear == "dense":
            continue
        c = cfg.copy_and_resolve_references()
        c.parallel.update(context_attention=attention, context_kv=kv)
        t = traffic(c)
        out[f"{attention}/{kv}"] = {k: v["elements"] for k, v in t.get("step", {}).items()}
    return out


def to_markdown(rows, layers: int) -> str:
    gib = 2**30
    lines = [
        f"Per device, one row of seq tokens split over C devices (context = C), {layers} layers of the "
        "model's widths, bf16, remat none, chunked attention; temp = activations + gradients + workspace, "
        "arg = parameters + optimizer state + batch.",
        "",
        "| model | seq | C | target | arg GiB | temp GiB | temp / temp(C=1) | ring full | ring bottleneck | "
        "all_gather full | all_gather bottleneck |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r["model"], r["seq"], r["target"]): r["temp_bytes"] for r in rows if r["context"] == 1}
    for r in rows:
        ref = base.get((r["model"], r["seq"], r["target"]))
        ex = r["exchange"]
        cell = lambda key: (
            "-"
            if key not in ex or not ex[key]
            else ", ".join(  # noqa: E731
                f"{v / 1e6:.1f}M {k.replace('collective-permute', 'CP').replace('all-gather', 'AG').replace('reduce-scatter', 'RS')}"  # noqa: E501
                for k, v in ex[key].items()
            )
        )
        ratio = f"{r['temp_bytes'] / ref:.3f}" if ref else "-"
        cells = " | ".join(
            cell(k) for k in ("ring/full", "ring/bottleneck", "all_gather/full", "all_gather/bottleneck")
        )
        lines.append(
            f"| {r['model']} | {r['seq']} | {r['context']} | {r['target']} | {r['argument_bytes'] / gib:.2f} | "
            f"{r['temp_bytes'] / gib:.2f} | {ratio} | {cells} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="cola_7b,llama_7b")
    ap.add_argument("--seqs", default="8192,32768,131072")
    ap.add_argument("--contexts", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--targets", default="cpu,h100")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    emulate_cpu_devices(max(contexts))
    import jax

    jax.config.update("jax_platforms", "cpu")
    rows = []
    for model in args.models.split(","):
        for seq in (int(x) for x in args.seqs.split(",")):
            for c in contexts:
                cfg = config(model, seq, c, args.layers)
                for target in args.targets.split(","):
                    row = {
                        "model": model,
                        "seq": seq,
                        "context": c,
                        "target": target,
                        "layers": args.layers,
                        **measure(cfg, target),
                        "exchange": exchange(cfg),
                    }
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    out = {"rows": rows, "method": __doc__.split("\n\n")[2].replace("\n", " ")}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    text = to_markdown(rows, args.layers)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    print(text)
    return out


if __name__ == "__main__":
    main()
