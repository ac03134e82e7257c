"""Pipeline parallelism: a GPipe schedule over the `pipeline` mesh axis, written for GSPMD.

The layer stack [L, ...] is cut into S stages of L/S consecutive layers (the `layers` dim is split
over `pipeline`). The batch is cut into M micro-batches. At every tick all S stages run at once
(a vmap over the stage dim, which GSPMD splits over `pipeline`), then the stage outputs shift one
stage down (a roll of the stage dim: one collective-permute) and the next micro-batch enters stage 0.
After M + S - 1 ticks every micro-batch has crossed every stage; the bubble is (S-1)/(M+S-1) of the
ticks. Autodiff of the loop gives the backward (all micro-batches' activations are kept, as in
GPipe; combine with a remat policy). Tensor, FSDP and data parallelism act inside each stage
unchanged, because the strategy's constraints are batched with `spmd_axis_name="pipeline"`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def bubble_fraction(stages: int, microbatches: int) -> float:
    return (stages - 1) / (microbatches + stages - 1)


def to_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...] with micro-batch j = rows j, M+j, 2M+j, ...: every device's
    contiguous block of the batch keeps a share of every micro-batch, so none moves."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def from_microbatches(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


@jax.custom_vjp
def shift_stages(x: jax.Array) -> jax.Array:
    """Stage s's output becomes stage s+1's input: a roll of the stage dim, one collective-permute.
    The custom VJP rolls the cotangent back the same way (one permute); autodiff of jnp.roll would
    transpose its slice + concatenate into two one-way permutes per tick."""
    return jnp.roll(x, 1, axis=0)


shift_stages.defvjp(lambda x: (shift_stages(x), None), lambda _, g: (jnp.roll(g, -1, axis=0),))


def gpipe(stage_fn, layer_state, x: jax.Array, *, stages: int, microbatches: int, unroll: bool = False) -> jax.Array:
    """Run `stage_fn(stage_state, x_micro) -> x_micro` over the stages for every micro-batch.

    layer_state: a pytree whose leaves have a leading [L] layer dim; x: [B, ...]."""
    staged = jax.tree.map(lambda a: a.reshape(stages, a.shape[0] // stages, *a.shape[1:]), layer_state)
    micro = to_microbatches(x, microbatches)  # [M, b, ...]
    run_stages = jax.vmap(stage_fn, spmd_axis_name="pipeline")
    stage_ids = jnp.arange(stages).reshape((stages,) + (1,) * (micro.ndim - 1))

    def tick(carry, t):
        inputs, outputs = carry
        # Micro-batch t enters stage 0 (after the bubble ticks the slot is never read again).
        entering = jax.lax.dynamic_index_in_dim(micro, jnp.minimum(t, microbatches - 1), keepdims=False)
        inputs = jnp.where(stage_ids == 0, entering[None], inputs)
        out = run_stages(staged, inputs)
        # Every stage files its output in its own row of `outputs` (stage-local, no traffic); the last
        # stage's row ends up holding micro-batch t-(S-1) at slot t-(S-1). Earlier ticks write slot 0,
        # overwritten later.
        done = jnp.maximum(t - (stages - 1), 0)
        outputs = jax.lax.dynamic_update_index_in_dim(outputs, out[:, None], done, 1)
        return (shift_stages(out), outputs), None

    inputs = jnp.zeros((stages,) + micro.shape[1:], x.dtype)
    outputs = jnp.zeros((stages,) + micro.shape, x.dtype)  # [S, M, b, ...]
    (_, outputs), _ = jax.lax.scan(tick, (inputs, outputs), jnp.arange(microbatches + stages - 1),
                                   unroll=unroll)
    # One hand-over of the finished micro-batches from the last stage, instead of one per tick.
    outputs = outputs[stages - 1]
    return from_microbatches(outputs)
