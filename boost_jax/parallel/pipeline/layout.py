"""How the pipeline stages hold the layer stack and the batch: micro-batches, the stage layouts of
the stored [L, ...] stacks (gpipe's contiguous blocks, circular's interleaved chunks), and the
per-replica float32 copies of a stage's weights whose gradient is summed over the batch replicas
once per pass (stack.py's module docstring says why)."""

from __future__ import annotations

import contextvars

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# The train step's per-replica copies of the layer stack while it traces its loss (stack.py `accumulate`);
# the schedules take them in place of the stack's own layout.
STEP_COPIES: contextvars.ContextVar = contextvars.ContextVar("stage_copies", default=None)


def to_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...] with micro-batch j = rows j, M+j, 2M+j, ...: every device's
    contiguous block of the batch keeps a share of every micro-batch, so none moves."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def from_microbatches(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def once_per_pass_axes(mesh, strategy) -> tuple[str, ...]:
    """The batch axes over which the stages' weight gradients are reduced once per pass (see
    parallel/pipeline/stack.py); () leaves the reduction where GSPMD places it, every tick.
    Spatial-temporal projections keep GSPMD's placement: their Cannon schedule runs on the (fsdp,
    tensor) grid itself."""
    if strategy.st_groups:
        return ()
    return tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)


def stage_layout(a: jax.Array, stages: int, repeats: int | None = None) -> jax.Array:
    """A layer-stacked [L, ...] as the stages hold it: gpipe (repeats None) [S, L/S, ...], stage s the
    layers [s L/S, (s+1) L/S); circular [S, V, L/(S V), ...], stage s the chunks s, S+s, 2S+s, ...
    (chunk c = layers [c L/(S V), (c+1) L/(S V))). The stored [L] dim is split over `pipeline` in
    contiguous blocks, so the circular layout moves each stage's weights between stages (once per
    pass, before the tick loop; their gradient once after it)."""
    if repeats is None:
        return a.reshape(stages, a.shape[0] // stages, *a.shape[1:])
    chunks = a.reshape(repeats, stages, a.shape[0] // (stages * repeats), *a.shape[1:])
    return jnp.swapaxes(chunks, 0, 1)


def layer_layout(a: jax.Array, repeats: int | None = None) -> jax.Array:
    """The inverse of `stage_layout`: [S, ...] -> [L, ...]."""
    if repeats is not None:
        a = jnp.swapaxes(a, 0, 1)
        return a.reshape(a.shape[0] * a.shape[1] * a.shape[2], *a.shape[3:])
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def on_stages(x: jax.Array, mesh, lead: int = 1, rest=None) -> jax.Array:
    """x split over `pipeline` on its leading dim, `lead - 1` whole dims after it, then `rest` (the
    stored weight's spec past its layer dim; None: as XLA likes). Pins where the circular layout's
    reorder happens: one all-to-all over `pipeline` of the stored weights and one of the summed
    gradient, each keeping its other splits."""
    tail = [P.UNCONSTRAINED] * (x.ndim - lead) if rest is None else list(rest) + [None] * (x.ndim - lead - len(rest))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("pipeline", *([None] * (lead - 1)), *tail)))


def copy_spec(spmd, ndim: int, repeats: int | None) -> P:
    """The spec of the copies of an [L, ...] weight of `ndim` dims: split over the pipeline and replica
    axes, every other dim as the stages use it. It must name every dim: a dim a PartitionSpec leaves
    out is replicated (the circular layout's extra chunk dim once left the last dim out, and XLA
    gathered each weight split along it over tensor)."""
    return P(spmd, *([P.UNCONSTRAINED] * (ndim + (repeats is not None))))  # [S n, (V,) L/(S V), ...]


def stage_copies(
    w: jax.Array, stages: int, n: int, sharding: NamedSharding, repeats: int | None, rest=None
) -> jax.Array:
    """[L, ...] -> [S * n, ...stage layout]: every replica's copy of its stage's layers. `rest`: see
    `on_stages`."""
    if repeats is None:  # gpipe
        staged = w.reshape(stages, 1, w.shape[0] // stages, *w.shape[1:])
    else:
        staged = stage_layout(w if rest is None else on_stages(w, sharding.mesh, 1, rest), stages, repeats)
        staged = (staged if rest is None else on_stages(staged, sharding.mesh, 3, rest))[:, None]
    out = jnp.broadcast_to(staged, (stages, n) + staged.shape[2:]).reshape(stages * n, *staged.shape[2:])
    return jax.lax.with_sharding_constraint(out, sharding)


def sum_stage_copies(
    g: jax.Array, stages: int, n: int, reduce_dtype, repeats: int | None, mesh, rest=None
) -> jax.Array:
    """The copies' gradient [S * n, ...] summed over the replicas (once, in `reduce_dtype`) -> [L, ...]."""
    g = g.reshape(stages, n, *g.shape[1:]).astype(reduce_dtype).sum(1)
    if repeats is None:
        return layer_layout(g)
    return on_stages(layer_layout(on_stages(g, mesh, 3, rest), repeats), mesh, 1, rest)


def replica_copies(
    a: jax.Array, stages: int, n: int, sharding: NamedSharding, reduce_dtype, repeats: int | None = None
) -> jax.Array:
    """A layer-stacked weight [L, ...] as [S * n, ...stage layout]: stage s's layers copied once per
    batch replica (row s * n + i: stage s, replica i; split over the pipeline and replica axes), in
    float32 when it is a float. Each replica accumulates its own gradient in its copy's cotangent over
    the ticks; the backward sums the n of them once, in `reduce_dtype`."""

    def forward(w):
        return stage_copies(w, stages, n, sharding, repeats)

    if not jnp.issubdtype(a.dtype, jnp.floating):
        return forward(a)  # no gradient
    acc = jnp.promote_types(a.dtype, jnp.float32)

    @jax.custom_vjp
    def copies(w):
        return forward(w.astype(acc))

    def bwd(_, g):
        return (sum_stage_copies(g, stages, n, reduce_dtype, repeats, sharding.mesh).reshape(a.shape).astype(a.dtype),)

    copies.defvjp(lambda w: (copies(w), None), bwd)
    return copies(a)
