"""Logical-axis sharding: a strategy is a table of logical axis -> mesh axes, never a model fork.

Modules name the axes of their parameters (`embed`, `rank`, `heads`, ...) and of the activations
they produce (`act_batch`, `act_embed`, ...). `use_rules(mesh, rules)` makes a table current;
`constrain(x, names)` then pins an activation's layout, and `spec_for(names, shape)` turns a
parameter's names into a PartitionSpec. With no table active both are no-ops, so single-device
code pays nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# (logical name, mesh axis or tuple of axes). A name may appear several times: first fit wins, so a
# later row is a fallback used when the earlier axes are taken by another dim or do not divide it.
Rules = Sequence[tuple[str, object]]

_CURRENT: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("rules", default=None)


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules):
    token = _CURRENT.set((mesh, tuple(rules)))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> tuple[Mesh, Rules] | None:
    return _CURRENT.get()


def _as_tuple(axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def spec_for(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Rules) -> P:
    """PartitionSpec for an array whose dims carry `names`: first rule whose mesh axes are free and
    whose size divides the dim; mesh axes of size 1 are dropped so specs stay readable."""
    used: set[str] = set()
    out = []
    for name, dim in zip(names, shape):
        chosen = None
        for logical, axes in rules:
            if logical != name:
                continue
            axes = tuple(a for a in _as_tuple(axes) if mesh.shape[a] > 1)
            if not axes:
                chosen = None
                break
            size = 1
            for a in axes:
                size *= mesh.shape[a]
            if used.isdisjoint(axes) and dim % size == 0:
                chosen = axes
                break
        if chosen:
            used.update(chosen)
            out.append(chosen[0] if len(chosen) == 1 else chosen)
        else:
            out.append(None)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin an activation to the current table's layout (no-op without one)."""
    ctx = _CURRENT.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(names, x.shape, mesh, rules)))


# Batch dims of activations are split over every data-parallel axis, whatever the strategy.
BATCH_RULES: Rules = (("act_batch", ("data", "fsdp")),)


def strategy_rules(strategy: str) -> Rules:
    """The logical-axis table of a parallel strategy (see parallel/strategies.py when present)."""
    return BATCH_RULES
