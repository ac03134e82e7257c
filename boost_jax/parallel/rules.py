"""Logical-axis sharding: a strategy is a table of logical axis -> mesh axes, never a model fork.

Modules name the axes of their parameters (`embed`, `rank`, `heads`, ...) and of the activations
they produce (`act_batch`, `act_embed`, ...). `use_rules(mesh, strategy)` makes a strategy current;
`constrain(x, names)` then pins an activation's layout, and `spec_for(names, shape)` turns a
parameter's names into a PartitionSpec. With no strategy active both are no-ops, so single-device
code pays nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# (logical name, mesh axis | tuple of axes | None). A name may appear several times: first fit wins,
# so a later row is a fallback used when the earlier axes are taken by another dim of the same array,
# do not divide it, or have size 1 on this mesh. An explicit None row means "replicate, stop looking".
Rules = Sequence[tuple[str, object]]


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    rules: tuple
    online_norm: bool = False  # BTP: a norm in front of row-parallel A's sends its statistics with them
    st_groups: frozenset = frozenset()  # projection groups run as PrimePar P(n x n) on (fsdp, tensor)
    microbatches: int = 1  # pipeline micro-batches per pass (used when the mesh has pipeline > 1)
    grad_reduce_dtype: str = "float32"  # dtype of the once-per-step gradient all-reduce over `data`

    @property
    def compute_rules(self) -> tuple:
        """The rules a weight is used under: its stored layout without `fsdp` (gathered for use)."""
        return tuple((name, axes) for name, axes in self.rules if "fsdp" not in _as_tuple(axes))


_CURRENT: contextvars.ContextVar[tuple[Mesh, Strategy] | None] = contextvars.ContextVar("rules", default=None)


@contextlib.contextmanager
def use_rules(mesh: Mesh, strategy: Strategy):
    token = _CURRENT.set((mesh, strategy))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> tuple[Mesh, Strategy] | None:
    return _CURRENT.get()


def _as_tuple(axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def spec_for(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Rules) -> P:
    """PartitionSpec for an array whose dims carry `names` (see `Rules` for the first-fit order)."""
    used: set[str] = set()
    out = []
    for name, dim in zip(names, shape):
        chosen = None
        for logical, axes in rules:
            if logical != name:
                continue
            if axes is None:
                break
            axes = tuple(a for a in _as_tuple(axes) if mesh.shape[a] > 1)
            size = 1
            for a in axes:
                size *= mesh.shape[a]
            if axes and used.isdisjoint(axes) and dim % size == 0:
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


def logical_spec(names: Sequence[str | None], shape: Sequence[int]) -> P | None:
    """The current strategy's spec for an activation, or None outside a strategy."""
    ctx = _CURRENT.get()
    if ctx is None:
        return None
    mesh, strategy = ctx
    return spec_for(names, shape, mesh, strategy.rules)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin an activation to the current strategy's layout (no-op without one)."""
    ctx = _CURRENT.get()
    if ctx is None:
        return x
    mesh, strategy = ctx
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(names, x.shape, mesh, strategy.rules)))


def gathered(w: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """A weight in its compute layout: FSDP's all-gather happens here, right before use, and the
    gradient is reduce-scattered back by the transpose. Being explicit also keeps XLA from choosing
    a weight-gradient layout it mis-partitions (seen with jax 0.10: a weight split (tensor, fsdp)
    under a batch split over fsdp got its gradient all-reduced across different fsdp blocks)."""
    ctx = _CURRENT.get()
    if ctx is None:
        return w
    mesh, strategy = ctx
    spec = spec_for(names, w.shape, mesh, strategy.compute_rules)
    return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, spec))
