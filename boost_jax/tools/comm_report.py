"""Per-device communication of each tensor-parallel strategy, read from compiled HLO (nothing allocated).

    python -m boost_jax.tools.comm_report --config configs/cola_7b.py --mesh 1,1,4 \
        --strategy btp,vanilla,megatron [--batch 4] [--seq 4096] [--dtype bfloat16] \
        [--json PATH] [--markdown PATH] [--no-memory]

For each strategy the model is lowered from abstract shapes (ShapeDtypeStructs carrying the state's
shardings) and compiled three ways: the forward loss, forward+backward (jax.grad of the loss, grads
in the parameters' layout) and the real train step (`boost_jax/runtime/build.py`, the trainer's). Each is compiled
with the
layer scan unrolled at n_layers=1 and 2 so every layer's collectives are listed separately:
per layer = (2 layers) - (1 layer), the rest (embedding, head, loss, optimizer) = (1 layer) - per
layer, and the whole model = rest + L x per layer ("lowered at 1 and 2 layers, scaled to L").

Strategies: any registered (`btp`, `vanilla`, `megatron`, ...: boost_jax/parallel/strategies.py; by
default every one), optionally `NAME:LINEAR` (LINEAR: any linear kind, boost_jax/model/kinds/). A name
alone measures the kind its registry entry reports it on (`report_linear`: `megatron` alone means the
full-rank (dense) twin of the config, the baseline BOOST compares with; `megatron:cola` forces the
low-rank model), else the config's own `model.linear`.

Bytes are elements x each collective's own dtype as the program has it right after SPMD
partitioning (`hlo_comm.partitioned_hlo`, from the same compile): there a bf16 weight gather or
activation all-reduce is bf16 and a float32 gradient reduction float32. The optimized CPU program's
dtypes are not used: XLA's CPU backend carries bf16 all-reduces and all-gathers as float32. Counts
and elements are read from the optimized program; each kind@axes class is priced at its
partitioned bytes per element.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time

from boost_jax.tools.devices import emulate_cpu_devices, load_config, parse_mesh, pick_devices

PROGRAMS = ("forward", "forward_backward", "train_step")
GIB = 2**30
FIELDS = ("count", "elements", "bytes")  # of a tally entry
SHORT = {
    "all-reduce": "AR",
    "all-gather": "AG",
    "reduce-scatter": "RS",
    "all-to-all": "A2A",
    "collective-permute": "CP",
}


# ---------------------------------------------------------------- tallies: {"kind@axes": {count, elements}}


def _key(c) -> str:
    return f"{c.kind}@{'+'.join(c.axes) or 'none'}"


def itemsize(dtype: str) -> float:
    """Bytes per element of an HLO dtype name (f32, bf16, pred, s8, f8e4m3fn, ...)."""
    if dtype == "pred":
        return 1
    bits = re.search(r"\d+", dtype)
    return int(bits.group(0)) / 8 if bits else 0


def bytes_per_element(collectives) -> dict:
    """{kind@axes: bytes per element} over these collectives, each at its own dtype."""
    acc: dict = {}
    for c in collectives:
        e, b = acc.get(_key(c), (0, 0.0))
        acc[_key(c)] = (e + c.elements, b + c.elements * itemsize(c.dtype))
    return {k: b / e for k, (e, b) in acc.items() if e}


def _tally(collectives, per_element: dict | None = None) -> dict:
    """{kind@axes: count, elements, bytes} as executed: a collective inside loops counts once per trip
    (`Collective.trips`, e.g. the chunked loss's scan over vocab-parallel chunks); bytes at
    `per_element[kind@axes]` (from the partitioned program), else at the collective's own dtype."""
    out: dict = {}
    for c in collectives:
        if c.trips is None:
            raise RuntimeError(
                f"a {c.kind} over {'+'.join(c.axes) or 'no axis'} ({c.op_name or c.computation}) "
                "runs inside a loop without a known trip count: its traffic cannot be counted"
            )
        slot = out.setdefault(_key(c), {"count": 0, "elements": 0, "bytes": 0.0})
        slot["count"] += c.trips
        slot["elements"] += c.elements * c.trips
        slot["bytes"] += c.elements * c.trips * (per_element or {}).get(_key(c), itemsize(c.dtype))
    return out


def _combine(a: dict, b: dict, wa: int = 1, wb: int = 1) -> dict:
    """wa*a + wb*b, entries that cancel dropped."""
    out = {}
    for k in sorted(set(a) | set(b)):
        slot = {f: wa * a.get(k, {}).get(f, 0) + wb * b.get(k, {}).get(f, 0) for f in FIELDS}
        if slot["count"] or slot["elements"]:
            out[k] = slot
    return out


def axis_group(key: str) -> str:
    """'tensor' (activations), 'grid' (the spatial-temporal groups' permutes on the fsdp x tensor
    grid: activations and compute-dtype weight blocks), 'context' (the attention's K/V exchange over
    the sequence split) or 'data_fsdp' (gradients, parameters; anything else touching data/fsdp/context)."""
    kind, axes = key.split("@")
    axes = set(axes.split("+"))
    if axes == {"context"} and kind != "all-reduce":  # the attention's exchange over the sequence split
        return "context"
    if kind == "collective-permute" and "fsdp" in axes and not {"data", "pipeline"} & axes:
        return "grid"
    return "data_fsdp" if {"data", "fsdp", "context"} & axes else "tensor"  # context: gradients, like data


def _sum_by(tally: dict, group) -> dict:
    out: dict = {}
    for k, v in tally.items():
        slot = out.setdefault(group(k), {f: 0 for f in v})
        for f, x in v.items():
            slot[f] += x
    return out


# ---------------------------------------------------------------- configs and compiles


def parse_strategies(text) -> list[tuple[str, str | None]]:
    """'btp,megatron:cola' -> [('btp', None), ('megatron', 'cola')]; None: the default linear.
    Names come from the strategy and linear-kind registries; text None: every registered strategy."""
    from boost_jax.model import kinds
    from boost_jax.parallel import strategies

    text = strategies.names() if text is None else text
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        name, _, linear = item.strip().partition(":")
        if name not in strategies.names():
            raise SystemExit(f"--strategy: {name!r} is not one of {strategies.names()}")
        if linear and linear not in kinds.names():
            raise SystemExit(f"--strategy: {item!r}: the part after ':' must be one of {kinds.names()}")
        out.append((name, linear or None))
    return out


def variant_config(
    base,
    strategy: str,
    linear: str | None,
    mesh,
    batch: int,
    seq: int,
    dtype: str,
    remat: str | None = None,
    context: int = 1,
):
    """The config one strategy column is measured on (depth and unrolling are set per compile);
    mesh = (data, fsdp, tensor), `context` the sequence split."""
    from boost_jax.model.kinds import kind_class
    from boost_jax.parallel.strategies import registered
    from boost_jax.validate import validate

    c = base.copy_and_resolve_references()
    linear = linear or registered(strategy).report_linear or c.model.linear
    if linear != c.model.linear:  # the twin: same shapes, other projection kind (cola_7b <-> llama_7b)
        was, kind = kind_class(c.model.linear), kind_class(linear)
        if was.family and kind.family and c.name.startswith(was.family + "_"):
            c.name = kind.family + c.name[len(was.family) :]
        c.model.linear = linear
        c.model.only_lr_act = c.model.only_lr_act and kind.nonlinear(c.model)
    c.model.dtype = dtype
    c.remat.policy = remat or c.remat.policy
    c.model.max_seq_len = max(c.model.max_seq_len, seq)
    c.train.update(seq_len=seq, global_batch=batch, grad_accum=1)
    data, fsdp, tensor = mesh
    c.parallel.update(
        data=data, fsdp=fsdp, tensor=tensor, context=context, num_devices=math.prod(mesh) * context, strategy=strategy
    )
    c.data.source = "embedded"  # nothing is read; a zoo config's `tokens` source would need a path
    return validate(c)


def compile_program(cfg, program: str, devices, n_layers: int, unroll: bool, partitioned: bool = False):
    """(compiled, mesh, seconds) for one program at one depth, from abstract shapes only (the runtime's
    builder: the trainer's own steps); with `partitioned`, also its HLO right after SPMD partitioning
    (collectives in their logical dtypes)."""
    import jax

    from boost_jax.runtime.build import build
    from boost_jax.runtime.state import trainable, with_frozen

    cfg = cfg.copy_and_resolve_references()
    cfg.model.n_layers, cfg.model.scan_unroll = n_layers, unroll
    start = time.perf_counter()
    built = build(cfg, devices)
    spec, batch = built.spec, built.abstract_batch()
    if program == "train_step":
        lowered = built.lower_train()
    else:
        loss = built.loss_fn()

        # Gradients come out in the parameters' layout, as the optimizer receives them.
        def grads(params, b):  # of the trainable leaves, as in the train step
            return jax.grad(lambda t: loss(with_frozen(t, params), first(b)))(trainable(params))

        first = lambda b: jax.tree.map(lambda x: x[0], b)  # noqa: E731 - one micro-batch
        fn = (
            jax.jit(lambda params, b: loss(params, first(b)))
            if program == "forward"
            else jax.jit(grads, out_shardings=trainable(spec.abstract["params"], spec.shardings["params"]))
        )
        lowered = fn.lower(spec.abstract["params"], batch)
    if partitioned:
        from boost_jax.tools.hlo_comm import compile_partitioned

        compiled, text = compile_partitioned(lowered)
        return compiled, built.mesh, time.perf_counter() - start, text
    return lowered.compile(), built.mesh, time.perf_counter() - start


def _cost_flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float(cost.get("flops", 0.0)) if cost else None


def memory_breakdown(compiled) -> dict | None:
    """A compiled program's memory_analysis() per device: arguments, outputs, temporaries, aliased
    (donated) bytes and their total, the peak; None where the backend reports none."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    arg, out, temp = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
    alias = m.alias_size_in_bytes  # donated state: its outputs reuse the argument buffers
    return {
        "argument_bytes": arg,
        "output_bytes": out,
        "temp_bytes": temp,
        "alias_bytes": alias,
        "total_bytes": arg + out + temp - alias,
    }


# ---------------------------------------------------------------- one strategy


def measure(cfg, devices, memory: bool = True, programs=PROGRAMS, log=None) -> dict:
    """Every number for one strategy column (cfg from `variant_config`). `log(what)`, if given, is
    called before each compile."""
    from boost_jax.model import flops_per_token
    from boost_jax.model.transformer import compute_dtype
    from boost_jax.tools.hlo_comm import parse_collectives

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
            tallies.append(_tally(cs, bytes_per_element(parse_collectives(text, mesh))))
            res["compile_s"][f"{program}@{layers}"] = round(seconds, 2)
            if program == "train_step":
                xla_flops.append(_cost_flops(compiled))
        layer = _combine(tallies[1], tallies[0], 1, -1)
        rest = _combine(tallies[0], layer, 1, -1)
        total = _combine(rest, layer, 1, depth)
        res["programs"][program] = {"per_layer": layer, "rest": rest, "total": total}

    progs = res["programs"]
    fwd = progs["forward"]["per_layer"]
    bwd = _combine(progs["forward_backward"]["per_layer"], fwd, 1, -1) if "forward_backward" in progs else {}
    for name, tally in (("forward", fwd), ("backward", bwd)):
        by_axis = _sum_by(tally, axis_group)
        res[f"per_layer_{name}"] = {
            g: {**v, "elements_per_token": v["elements"] / tokens} for g, v in sorted(by_axis.items())
        }
    fwd_t = res["per_layer_forward"].get("tensor", {}).get("elements_per_token", 0.0)
    res["per_layer_forward_units"] = {"r": fwd_t / m.rank, "d": fwd_t / m.d_model}
    if "train_step" in progs:
        total = progs["train_step"]["total"]
        res["step_by_kind"] = _sum_by(total, lambda k: k.split("@")[0])
        res["step_by_axis"] = _sum_by(total, axis_group)
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
    from boost_jax.parallel.context import traffic

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


# ---------------------------------------------------------------- printing


def _fmt_kinds(by_kind: dict) -> str:
    return ", ".join(f"{v['count']} {SHORT.get(k, k)}" for k, v in sorted(by_kind.items()))


def _fmt_by_kind(c: dict, group: str) -> str:
    """'AG 0.123 (2.0), AR 0.456 (4.0)': one traffic class's train-step bytes by collective kind."""
    kinds: dict = {}
    for key, v in _get(c, "programs", "train_step", "total", default={}).items():
        if axis_group(key) == group:
            slot = kinds.setdefault(key.split("@")[0], [0, 0.0])
            slot[0] += v["elements"]
            slot[1] += v["bytes"]
    parts = [f"{SHORT.get(k, k)} {_gib(b)} ({b / e:.1f})" for k, (e, b) in sorted(kinds.items()) if e]
    return ", ".join(parts) or "-"


def _get(x, *path, default=0.0):
    for p in path:
        if not isinstance(x, dict) or p not in x:
            return default
        x = x[p]
    return x


def _gib(nbytes: float) -> str:
    x = nbytes / GIB
    return f"{x:.3f}" if x >= 0.01 or x == 0 else f"{x:.2e}"


def _layer(c: dict, direction: str, group: str, field: str):
    return _get(c, f"per_layer_{direction}", group, field, default=0)


def to_markdown(rep: dict) -> str:
    cols = rep["strategies"]
    r, d = rep["rank"], rep["d_model"]

    def row(label, fn):
        return f"| {label} | " + " | ".join(fn(c) for c in cols.values()) + " |"

    def per_token(c, direction):
        return (
            f"{_layer(c, direction, 'tensor', 'elements_per_token'):.0f} "
            f"({_layer(c, direction, 'tensor', 'count')} coll.)"
        )

    def both(c, group):
        return _layer(c, "forward", group, "bytes") + _layer(c, "backward", group, "bytes")

    def xla_flops(c):
        x = _get(c, "flops", "xla_per_device_step", default=None)
        return "-" if x is None else f"{x / 1e12:.3g}"

    def memory(c):
        m = c.get("memory")
        keys = ("argument_bytes", "output_bytes", "temp_bytes", "total_bytes")
        return "-" if not m else " / ".join(f"{m[k] / GIB:.1f}" for k in keys)

    mesh = rep["mesh"]
    title = (
        f"**{rep['config']}**, mesh data={mesh['data']} fsdp={mesh['fsdp']} context={mesh.get('context', 1)} "
        f"tensor={mesh['tensor']}, "
        f"batch {rep['batch']} x seq {rep['seq']}, {rep['dtype']}, L = {rep['n_layers']} "
        "(lowered at 1 and 2 layers, scaled to L), per device per step."
    )
    lines = [
        title,
        "",
        "| | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
        row("model", lambda c: f"{c['config']} ({c['linear']})"),
        row("fwd / layer, tensor: elements/token", lambda c: per_token(c, "forward")),
        row(
            "fwd / layer, tensor: in r / in d",
            lambda c: f"{c['per_layer_forward_units']['r']:.2f} r / {c['per_layer_forward_units']['d']:.2f} d",
        ),
        row("bwd / layer, tensor: elements/token", lambda c: per_token(c, "backward")),
        row("fwd / layer, tensor: GiB", lambda c: _gib(_layer(c, "forward", "tensor", "bytes"))),
        row("fwd+bwd / layer, tensor: GiB", lambda c: _gib(both(c, "tensor"))),
        row("fwd+bwd / layer, data+fsdp: GiB", lambda c: _gib(both(c, "data_fsdp"))),
        row("train step, tensor: GiB", lambda c: _gib(_get(c, "step_by_axis", "tensor", "bytes"))),
        row("train step, data+fsdp: GiB", lambda c: _gib(_get(c, "step_by_axis", "data_fsdp", "bytes"))),
        row("train step, data+fsdp by kind: GiB (bytes/element)", lambda c: _fmt_by_kind(c, "data_fsdp")),
        row("train step: collectives", lambda c: _fmt_kinds(_get(c, "step_by_kind", default={}))),
    ]
    if any(c.get("context") for c in cols.values()):  # parallel.context: the sequence exchange, compiled / formula

        def exchange(c, part):
            x = (c.get("context") or {}).get(part, {})
            return ", ".join(f"{v['count']} {SHORT.get(k, k)} {v['elements']}" for k, v in sorted(x.items())) or "-"

        lines += [
            row(
                "train step, context (attention): count kind elements",
                lambda c: f"{exchange(c, 'compiled')} ({c['context']['attention']}, kv {c['context']['kv']})",
            ),
            row("train step, context: formula", lambda c: exchange(c, "formula")),
        ]
    if any(_get(c, "step_by_axis", "grid", "bytes") for c in rep["strategies"].values()):
        lines += [  # parallel.linear_partition: the st groups' permutes across fsdp
            row("fwd+bwd / layer, st grid: GiB", lambda c: _gib(both(c, "grid"))),
            row("train step, st grid: GiB", lambda c: _gib(_get(c, "step_by_axis", "grid", "bytes"))),
        ]
    lines += [
        row("TFLOP/device/step, analytic", lambda c: f"{c['flops']['analytic_per_device_step'] / 1e12:.3g}"),
        row("TFLOP/device/step, XLA cost_analysis", xla_flops),
    ]
    has_memory = any(c.get("memory") for c in cols.values())
    if has_memory:
        lines.append(row("peak memory GiB: arg / out / temp / total", memory))
    lines.append(row("compile seconds", lambda c: f"{sum(c['compile_s'].values()):.0f}"))
    lines += ["", "Per-layer forward tensor-axis traffic:"]
    for name, c in cols.items():
        x = _layer(c, "forward", "tensor", "elements_per_token")
        lines.append(
            f"- {name}: {x / r:.2f} r = {x / d:.2f} d ({x:.0f} elements/token, r={r}, d={d}); "
            f"{_gib(_layer(c, 'forward', 'tensor', 'bytes'))} GiB per layer forward "
            f"at {rep['batch']}x{rep['seq']} tokens"
        )
    lines += ["", rep["method"]]
    if has_memory:
        lines.append(
            "Peak memory: `.memory_analysis()` of the full-depth scanned train step, the "
            f"{rep['platform'].upper()} compiler's estimate (total = argument + output + temp - aliased), "
            f"remat policy `{rep['remat']}`."
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
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
    from boost_jax.errors import ConfigError

    context = 1
    if len(mesh) == 5:  # pipeline,data,fsdp,context,tensor
        pipeline, data, fsdp, context, tensor = mesh
        mesh = (pipeline, data, fsdp, tensor) if pipeline > 1 else (data, fsdp, tensor)
        if pipeline > 1 and context > 1:
            raise SystemExit("--mesh: the pipeline report runs without context; give pipeline 1 to report context")
    if len(mesh) == 4:
        from boost_jax.tools.progress import ticking

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


def pipeline_report(
    cfg_or_path,
    mesh,
    strategy: str | None = None,
    batch: int = 8,
    seq: int = 256,
    dtype: str = "bfloat16",
    remat: str | None = None,
    schedule: str | None = None,
    repeats: int = 1,
) -> dict:
    """A pipelined step's collectives by kind and mesh axis (whole step, every loop unrolled, so the
    pipeline's collective-permutes are counted once per tick). mesh = (pipeline, data, fsdp, tensor);
    strategy None: the first registered; schedule None: the config's (with `repeats` chunks per stage
    for circular and 1f1b). The per-layer method of `report` does not apply: layers only exist in
    whole stages. 1f1b's forward and backward sit in branches its stages take V M of its lockstep
    ticks: the counts are the unrolled program's operations, the branches' in every tick."""
    from boost_jax.parallel.pipeline import bubble_fraction, ticks, ticks_1f1b
    from boost_jax.parallel.strategies import names
    from boost_jax.tools.hlo_comm import parse_collectives, summarize

    strategy = strategy or names()[0]

    pipeline, *rest = mesh
    devices = pick_devices(math.prod(mesh))
    base = load_config(cfg_or_path)
    cfg = variant_config(base, strategy, base.model.linear, tuple(rest), batch, seq, dtype, remat)
    cfg.parallel.update(pipeline=pipeline, num_devices=math.prod(mesh))
    if schedule is not None:
        cfg.parallel.update(pipeline_schedule=schedule, pipeline_repeats=repeats)
    schedule, repeats = str(cfg.parallel.pipeline_schedule), int(cfg.parallel.pipeline_repeats)
    compiled, mesh_obj, seconds = compile_program(cfg, "train_step", devices, cfg.model.n_layers, unroll=True)
    table = summarize(parse_collectives(compiled.as_text(), mesh_obj), by=("kind", "axes"))
    micro = cfg.parallel.microbatches or 2 * pipeline
    n_ticks = ticks_1f1b(pipeline, micro, repeats) if schedule == "1f1b" else ticks(pipeline, micro, repeats)
    return {
        "config": base.name,
        "mesh": dict(zip(("pipeline", "data", "fsdp", "tensor"), mesh)),
        "strategy": strategy,
        "batch": batch,
        "seq": seq,
        "dtype": dtype,
        "n_layers": int(cfg.model.n_layers),
        "schedule": schedule,
        "repeats": repeats,
        "microbatches": micro,
        "ticks": n_ticks,
        "bubble": bubble_fraction(pipeline, micro, repeats),
        "compile_s": round(seconds, 2),
        "collectives": [{"kind": k, "axes": list(a), **v} for (k, a), v in sorted(table.items())],
    }


def pipeline_markdown(rep: dict) -> str:
    m = rep["mesh"]
    lines = [
        f"**{rep['config']}** ({rep['strategy']}), mesh pipeline={m['pipeline']} data={m['data']} "
        f"fsdp={m['fsdp']} tensor={m['tensor']}, batch {rep['batch']} x seq {rep['seq']}, {rep['dtype']}: "
        f"{rep.get('schedule', 'gpipe')}{' V ' + str(rep['repeats']) if rep.get('repeats', 1) > 1 else ''}, "
        f"{rep['microbatches']} micro-batches, {rep['ticks']} ticks"
        f"{' (lockstep: at most one forward and one backward each)' if rep.get('schedule') == '1f1b' else ''}, "
        f"bubble {100 * rep['bubble']:.1f}%. Whole train step per device, every loop unrolled.",
        "",
        "| kind | mesh axes | count | elements |",
        "|---|---|---|---|",
    ]
    for c in rep["collectives"]:
        lines.append(f"| {c['kind']} | {','.join(c['axes']) or '-'} | {c['count']} | {c['elements']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
