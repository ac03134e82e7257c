"""Per-device communication of each tensor-parallel strategy, read from compiled HLO (nothing allocated).

The command: each strategy measured (`measure`: a column's numbers from its three programs at 1 and
2 layers), the report over strategies (`report`), and `main`:

    python -m boost_jax.tools.comm_report --config configs/cola_7b.py --mesh 1,1,4 \
        --strategy btp,vanilla,megatron [--batch 4] [--seq 4096] [--dtype bfloat16] \
        [--json PATH] [--markdown PATH] [--no-memory]

Strategies: any registered (boost_jax/parallel/strategies.py; by default every one), optionally
`NAME:LINEAR` (any linear kind, boost_jax/model/kinds/). A name alone measures the kind its registry
entry reports it on (`report_linear`: `megatron` alone means the full-rank twin of the config, the
baseline BOOST compares with), else the config's own `model.linear`. Counts and elements are read
from the optimized program, each kind@axes class priced at its partitioned bytes per element.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from boost_jax.errors import ConfigError
from boost_jax.tools.comm_report.pipeline import pipeline_report
from boost_jax.tools.comm_report.programs import (
    compile_program,
    cost_flops,
    memory_breakdown,
    parse_strategies,
    variant_config,
)
from boost_jax.tools.comm_report.tables import pipeline_markdown, to_markdown
from boost_jax.tools.comm_report.tallies import (
    axis_group,
    bytes_per_element,
    combine,
    sum_by,
    tally_collectives,
)
from boost_jax.tools.devices import emulate_cpu_devices, load_config, parse_mesh, pick_devices
from boost_jax.tools.hlo_comm import parse_collectives
from boost_jax.tools.progress import ticking

PROGRAMS = ("forward", "forward_backward", "train_step")


# ---------------------------------------------------------------- one strategy


def measure(cfg, devices, memory: bool = True, programs=PROGRAMS, log=None) -> dict:
    """Every number for one strategy column (cfg from `variant_config`). `log(what)`, if given, is
    called before each compile."""
    from boost_jax.model import flops_per_token  # lazy: loads JAX; the callers set the emulated devices first
    from boost_jax.model.transformer import compute_dtype  # lazy: loads JAX (as above)

    m, p = cfg.model, cfg.parallel
    depth = m.n_layers
    tokens = cfg.train.global_batch * cfg.train.seq_len // (p.data * p.fsdp * p.context)  # per device
    act_bytes = compute_dtype(m.dtype).itemsize
    res: dict = {
        "strategy": p.strategy,
        "linear": m.linear,
        "config": cfg.name,
        "n_layers": depth,
        "model": {k: int(m[k]) for k in ("d_model", "d_ff", "rank", "n_heads", "n_kv_heads", "vocab_size")},
        "tokens_per_device": tokens,
        "activation_bytes": act_bytes,
        "compile_s": {},
        "programs": {},
    }
    xla_flops = []
    for program in programs:
        tallies = []
        for layers in (1, 2):
            if log:
                log(f"{program} at {layers} layer{'s' if layers > 1 else ''}")
            compiled, mesh, seconds, text = compile_program(
                cfg, program, devices, layers, unroll=True, partitioned=True
            )
            cs = parse_collectives(compiled.as_text(), mesh)  # the layer scan is unrolled; other loops
            tallies.append(tally_collectives(cs, bytes_per_element(parse_collectives(text, mesh))))
            res["compile_s"][f"{program}@{layers}"] = round(seconds, 2)
            if program == "train_step":
                xla_flops.append(cost_flops(compiled))
        layer = combine(tallies[1], tallies[0], 1, -1)
        rest = combine(tallies[0], layer, 1, -1)
        total = combine(rest, layer, 1, depth)
        res["programs"][program] = {"per_layer": layer, "rest": rest, "total": total}

    progs = res["programs"]
    fwd = progs["forward"]["per_layer"]
    bwd = combine(progs["forward_backward"]["per_layer"], fwd, 1, -1) if "forward_backward" in progs else {}
    for name, tally in (("forward", fwd), ("backward", bwd)):
        by_axis = sum_by(tally, axis_group)
        res[f"per_layer_{name}"] = {
            g: {**v, "elements_per_token": v["elements"] / tokens} for g, v in sorted(by_axis.items())
        }
    fwd_t = res["per_layer_forward"].get("tensor", {}).get("elements_per_token", 0.0)
    res["per_layer_forward_units"] = {"r": fwd_t / m.rank, "d": fwd_t / m.d_model}
    if "train_step" in progs:
        total = progs["train_step"]["total"]
        res["step_by_kind"] = sum_by(total, lambda k: k.split("@")[0])
        res["step_by_axis"] = sum_by(total, axis_group)
        res["context"] = context_section(cfg, total)

    fpt = flops_per_token(m, cfg.train.seq_len, training=True)
    n_dev = p.data * p.fsdp * p.context * p.tensor
    res["flops"] = {
        "analytic_per_token": fpt,
        "analytic_per_device_step": fpt * cfg.train.global_batch * cfg.train.seq_len / n_dev,
    }
    if len(xla_flops) == 2 and None not in xla_flops:  # same 1/2-layer scaling as the collectives
        layer_f = xla_flops[1] - xla_flops[0]
        res["flops"]["xla_per_device_step"] = xla_flops[0] - layer_f + depth * layer_f

    res["memory"] = None
    if memory:  # the program that runs: full depth, layers scanned
        if log:
            log(f"train_step at {depth} layers, scanned (peak memory)")
        compiled, _, seconds = compile_program(cfg, "train_step", devices, depth, unroll=False)
        res["compile_s"][f"train_step@{depth}(scan)"] = round(seconds, 2)
        res["memory"] = memory_breakdown(compiled)
    return res


def context_section(cfg, total: dict) -> dict | None:
    """Under parallel.context > 1: the train step's exchange over `context` as compiled ({kind:
    count, elements}) beside its formula (boost_jax/parallel/context.py `traffic`)."""
    from boost_jax.parallel.context import traffic  # lazy: loads JAX; the callers set the emulated devices first

    formula = traffic(cfg)
    if not formula:
        return None
    compiled = {
        k.split("@")[0]: {f: v[f] for f in ("count", "elements")}
        for k, v in total.items()
        if axis_group(k) == "context"
    }
    return {"attention": formula["attention"], "kv": formula["kv"], "compiled": compiled, "formula": formula["step"]}


def report(
    cfg_or_path,
    mesh=(1, 1, 4),
    strategies=None,
    batch: int = 4,
    seq: int = 4096,
    dtype: str = "bfloat16",
    memory: bool = True,
    programs=PROGRAMS,
    remat: str | None = None,
    context: int = 1,
    context_attention: str | None = None,
    context_kv: str | None = None,
    progress: bool = False,
) -> dict:
    """All numbers for each strategy (see the module docstring); JSON-serialisable. mesh = (data,
    fsdp, tensor); `context` > 1 splits the sequence too (its attention and kv modes: the config's
    unless given). `progress`: a line on stderr before each compile (the command line's)."""
    if "forward" not in programs:
        raise ValueError(f"programs={programs!r}: 'forward' is needed (backward = forward_backward - forward)")
    mesh = parse_mesh(mesh) if isinstance(mesh, str) else tuple(mesh)
    devices = pick_devices(math.prod(mesh) * context)
    base = load_config(cfg_or_path)
    base.parallel.update(
        {k: v for k, v in (("context_attention", context_attention), ("context_kv", context_kv)) if v is not None}
    )
    columns, chosen = {}, parse_strategies(strategies)
    count, start, total = 0, time.perf_counter(), len(chosen) * (2 * len(programs) + bool(memory))
    for name, linear in chosen:
        cfg = variant_config(base, name, linear, mesh, batch, seq, dtype, remat, context)
        label = name if linear is None else f"{name}:{linear}"

        def log(what, label=label):
            nonlocal count
            count += 1
            took = int(time.perf_counter() - start)
            print(
                f"comm_report: compiling {label} {what} ({count} of {total}; {took // 60}:{took % 60:02d} so far)",
                file=sys.stderr,
                flush=True,
            )

        columns[label] = measure(cfg, devices, memory=memory, programs=programs, log=log if progress else None)
    return {
        "config": base.name,
        "mesh": {**dict(zip(("data", "fsdp", "tensor"), mesh)), "context": context},
        "batch": batch,
        "seq": seq,
        "dtype": dtype,
        "remat": remat or base.remat.policy,
        "platform": devices[0].platform,
        "method": METHOD,
        "d_model": int(base.model.d_model),
        "rank": int(base.model.rank),
        "n_layers": int(base.model.n_layers),
        "strategies": columns,
    }


METHOD = (
    "Collectives read from the optimized HLO, per device per step; lowered at 1 and 2 layers "
    "(scan unrolled), scaled to L: per layer = 2-layer minus 1-layer, rest = 1-layer minus per layer. "
    "Bytes = elements x each collective's dtype as partitioned (before XLA:CPU widens bf16 collectives "
    "to f32): bf16 weight gathers and activations, f32 gradient reductions under bf16 compute. "
    "Elements per token: per device tokens = batch*seq/(data*fsdp*context)."
)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m boost_jax.tools.comm_report",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", required=True, help="a configs/*.py file, e.g. configs/cola_7b.py")
    ap.add_argument(
        "--mesh",
        default="1,1,4",
        help="data,fsdp,tensor or pipeline,data,fsdp,tensor or pipeline,data,fsdp,context,tensor sizes (default 1,1,4)",
    )
    ap.add_argument(
        "--strategy",
        help="comma list of registered strategies, each optionally NAME:LINEAR "
        "(default: every registered one; a bare name: the kind its entry reports it on)",
    )
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--markdown", help="write the table here")
    ap.add_argument("--no-memory", action="store_true", help="skip the full-depth compile for peak memory")
    ap.add_argument("--remat", help="remat.policy for every column (default: the config's)")
    ap.add_argument(
        "--schedule",
        choices=("gpipe", "circular", "1f1b"),
        help="a pipeline mesh's parallel.pipeline_schedule (default: the config's)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="with --schedule circular or 1f1b: chunks per stage V")
    args = ap.parse_args(argv)
    mesh = parse_mesh(args.mesh)
    emulate_cpu_devices(math.prod(mesh))  # before report() imports jax

    context = 1
    if len(mesh) == 5:  # pipeline,data,fsdp,context,tensor
        pipeline, data, fsdp, context, tensor = mesh
        mesh = (pipeline, data, fsdp, tensor) if pipeline > 1 else (data, fsdp, tensor)
        if pipeline > 1 and context > 1:
            raise SystemExit("--mesh: the pipeline report runs without context; give pipeline 1 to report context")
    if len(mesh) == 4:
        try:
            with ticking(f"comm_report: compiling the pipelined train step on mesh {args.mesh}"):
                rep = pipeline_report(
                    args.config,
                    mesh,
                    args.strategy and args.strategy.split(",")[0],
                    args.batch,
                    args.seq,
                    args.dtype,
                    schedule=args.schedule,
                    repeats=args.repeats,
                )
        except ConfigError as e:
            raise SystemExit(f"{e} (set via --mesh/--batch/--seq/--strategy)") from e
        print(pipeline_markdown(rep))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rep, f, indent=1)
        return rep

    try:
        rep = report(
            args.config,
            mesh,
            args.strategy,
            args.batch,
            args.seq,
            args.dtype,
            memory=not args.no_memory,
            remat=args.remat,
            context=context,
            progress=True,
        )
    except ConfigError as e:
        raise SystemExit(f"{e} (set via --mesh/--batch/--seq/--strategy/--remat)") from e
    text = to_markdown(rep)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return rep


if __name__ == "__main__":
    main(sys.argv[1:])
