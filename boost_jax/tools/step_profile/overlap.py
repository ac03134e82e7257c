"""Which collectives of a scheduled GPU program run beside compute, and how much of each the step
waits for (the step-time table prices them).

A scheduled module runs each computation's instructions in textual order on the compute stream; an
asynchronous collective runs on its own stream from its start to its done (`*-start` ... `*-done`,
or an `async-start` ... `async-done` pair around a computation holding it). The kernels scheduled
between them, and all the loops, calls and conditionals there run, are its window; a synchronous
collective has none. `windows(module, ks)` gives each collective kernel its window; `exposure(ks,
share)`: a collective overlaps min(its time, the compute in its window), the rest is exposed.
Compute is handed out in schedule order, each kernel's time once, so no compute hides two
collectives. A done waiting for a start of the previous loop iteration is not paired: that
collective counts as exposed, the upper bound. Nothing here imports jax.
"""

from __future__ import annotations

import re

from boost_jax.tools.hlo_comm import HloModule, Instruction

# Halves of asynchronous pairs: a done names its start as its first operand.
ASYNC_STARTS = {
    "all-reduce-start",
    "all-gather-start",
    "reduce-scatter-start",
    "all-to-all-start",
    "collective-permute-start",
    "async-start",
}
ASYNC_DONES = {
    "all-reduce-done",
    "all-gather-done",
    "reduce-scatter-done",
    "all-to-all-done",
    "collective-permute-done",
    "async-done",
}
_CALL_KEYS = {
    "while": ("body", "condition"),
    "conditional": ("true_computation", "false_computation", "branch_computations"),
    "call": ("calls", "to_apply"),
    "async-start": ("calls", "to_apply"),
}


def called(ins: Instruction) -> list[str]:
    """The computations an instruction runs as kernels: a while's body and condition, a
    conditional's branches, a call's or an async-start's computation (not fused computations)."""
    out = []
    for key in _CALL_KEYS.get(ins.opcode, ()):
        for m in re.finditer(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", ins.rest):
            out.extend(c.lstrip("%") for c in re.findall(r"%?([\w.\-]+)", m.group(1)))
    return out


def _first_operand(ins: Instruction) -> str:
    operands, _ = ins.operands_attrs()
    return re.sub(r"/\*.*?\*/", "", operands[0]).strip().rpartition(" ")[2].lstrip("%") if operands else ""


def _below(module: HloModule, comps: list[str]) -> set[str]:
    """`comps` and every computation they run as kernels, recursively."""
    seen, todo = set(), list(comps)
    while todo:
        c = todo.pop()
        if c in seen or c not in module.computations:
            continue
        seen.add(c)
        for ins in module.computations[c]:
            todo.extend(called(ins))
    return seen


def windows(module: HloModule, ks: list, trips: dict) -> None:
    """Set `window` on every asynchronous collective kernel of `ks` (the kernels of `module`, with
    their counts; `trips`: each computation's runs per step): ((computation, name, runs per run of
    the collective), ...) for each compute kernel between its start and its done. A synchronous
    collective keeps window None."""
    by_comp: dict[str, dict[str, object]] = {}
    for k in ks:
        by_comp.setdefault(k.computation, {})[k.name] = k
    for comp in {k.computation for k in ks} | {module.entry}:
        instrs = module.computations.get(comp, [])
        here = by_comp.get(comp, {})
        starts: dict[str, int] = {}
        for i, ins in enumerate(instrs):
            if ins.opcode in ASYNC_STARTS:
                starts[ins.name] = i
            elif ins.opcode in ASYNC_DONES and _first_operand(ins) in starts:
                lo = starts.pop(_first_operand(ins))
                targets = _collectives_of(instrs[lo], here, by_comp, module)
                if targets:
                    runs = trips.get(comp, 1) or 1
                    window = _between(module, instrs[lo + 1 : i], here, by_comp, runs)
                    for t in targets:
                        t.window = window


def _collectives_of(start: Instruction, here: dict, by_comp: dict, module: HloModule) -> list:
    """The collective kernels an async start runs: itself, or those of its async computation."""
    if start.opcode != "async-start":
        k = here.get(start.name)
        return [k] if k is not None and k.kind == "collective" else []
    return [k for c in _below(module, called(start)) for k in by_comp.get(c, {}).values() if k.kind == "collective"]


def _between(module: HloModule, instrs: list, here: dict, by_comp: dict, runs: int) -> tuple:
    """The compute kernels `instrs` run, each with its runs per run of their computation (`runs`)."""
    out = []
    for ins in instrs:
        k = here.get(ins.name)
        if k is not None:
            if k.kind not in ("collective", "sync"):
                out.append((k.computation, k.name, 1.0))
            continue
        nested = _below(module, called(ins))
        for c in nested:
            for kk in by_comp.get(c, {}).values():
                if kk.kind not in ("collective", "sync"):
                    out.append((kk.computation, kk.name, kk.count / runs))
    return tuple(out)


def exposure(ks: list, share: float = 1.0) -> list[dict]:
    """Per collective kernel of `ks` (priced: `time_s` set), in schedule order, per step: {"kernel",
    "weight" (1, or `share` for XLA's rematerialized clones), "priced_s", "overlapped_s", "exposed_s"}."""
    weight = {id(k): (share if k.remat_clone else 1.0) for k in ks}
    by_key = {(k.computation, k.name): k for k in ks}
    left = {key: weight[id(k)] * k.total_s() for key, k in by_key.items()}
    out = []
    for k in ks:
        if k.kind != "collective":
            continue
        need = weight[id(k)] * k.total_s()
        got = 0.0
        for comp, name, runs in k.window or ():
            if got >= need:
                break
            key = (comp, name)
            inner = by_key.get(key)
            if inner is None:
                continue
            can = min(left[key], weight[id(inner)] * inner.time_s * runs * k.count, need - got)
            left[key] -= can
            got += can
        out.append(
            {"kernel": k, "weight": weight[id(k)], "priced_s": need, "overlapped_s": got, "exposed_s": need - got}
        )
    return out
