"""Which branch of each conditional the step-time table prices. A conditional runs one of its
branches per execution; the program does not say which (the predicate is data: a 1F1B tick's stage
has an item or not, the last stage runs the head), so each conditional is priced at its costliest
branch, the step of the device that takes it: the other branches' kernels are `skipped`. A branch's
cost is its own kernels' plus, for each conditional inside it, that one's costliest branch's.
`paths(module)`: every executed computation's chain of enclosing branches, outermost first, each a
(conditional, branch computation) pair; one under no conditional has the empty chain. Nothing
here imports jax.
"""

from __future__ import annotations

from collections.abc import Callable

from boost_jax.tools.hlo_comm import HloModule
from boost_jax.tools.step_profile.overlap import called


def paths(module: HloModule) -> dict[str, tuple]:
    """{computation: its enclosing branches} for the computations the entry runs (loops, calls and
    conditionals walked; the first path that reaches a computation names it)."""
    out: dict[str, tuple] = {}
    todo = [(module.entry, ())]
    while todo:
        comp, path = todo.pop()
        if comp in out or comp not in module.computations:
            continue
        out[comp] = path
        for ins in module.computations[comp]:
            for callee in called(ins):
                key = (f"{comp}/{ins.name}", callee)
                todo.append((callee, path + (key,) if ins.opcode == "conditional" else path))
    return out


def skip_untaken(ks: list, cost: Callable) -> float:
    """Mark `skipped` every kernel of `ks` (each with its `branch` chain) outside the costliest
    branch of its conditionals, `cost(kernel)` its seconds per step; -> the seconds skipped."""
    tree: dict = {}  # {(conditional, branch): {"own": [kernels], "in": {sub-branch: ...}}}
    for k in ks:
        k.skipped = False
        node = None
        for key in k.branch:
            node = (tree if node is None else node["in"]).setdefault(key, {"own": [], "in": {}})
        if node is not None:
            node["own"].append(k)
    return _choose(tree, cost)


def _total(node: dict, cost: Callable) -> float:
    """A branch's seconds: its kernels' and its conditionals' costliest branches'."""
    return sum(cost(k) for k in node["own"]) + sum(max(v) for v in _by_conditional(node["in"], cost).values())


def _by_conditional(branches: dict, cost: Callable) -> dict:
    out: dict = {}
    for (cond, _), sub in branches.items():
        out.setdefault(cond, []).append(_total(sub, cost))
    return out


def _choose(branches: dict, cost: Callable) -> float:
    skipped = 0.0
    for cond in {c for c, _ in branches}:
        mine = {key: sub for key, sub in branches.items() if key[0] == cond}
        best = max(mine, key=lambda key: _total(mine[key], cost))
        for key, sub in mine.items():
            if key == best:
                skipped += _choose(sub["in"], cost)
            else:
                skipped += _skip(sub, cost)
    return skipped


def _skip(node: dict, cost: Callable) -> float:
    total = 0.0
    for k in node["own"]:
        k.skipped = True
        total += cost(k)
    return total + sum(_skip(sub, cost) for sub in node["in"].values())
