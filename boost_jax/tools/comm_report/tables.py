"""The tables tools/comm_report/ prints: one column per strategy (`to_markdown`), and a pipelined
step's collectives (`pipeline_markdown`)."""

from __future__ import annotations

from boost_jax.tools.comm_report.tallies import axis_group

GIB = 2**30
SHORT = {
    "all-reduce": "AR",
    "all-gather": "AG",
    "reduce-scatter": "RS",
    "all-to-all": "A2A",
    "collective-permute": "CP",
}


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
