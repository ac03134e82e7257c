"""The GPipe and circular (interleaved) pipeline schedules over the `pipeline` mesh axis, written for
GSPMD (`parallel.pipeline_schedule` = gpipe | circular; boost_jax/parallel/pipeline.py `run` calls them).

The layer stack [L, ...] is cut into S stages of L/S consecutive layers (the `layers` dim is split
over `pipeline`). The batch is cut into M micro-batches. At every tick all S stages run at once
(a vmap over the stage dim, which GSPMD splits over `pipeline`), then the stage outputs shift one
stage down (a roll of the stage dim: one collective-permute) and the next micro-batch enters stage 0.
After M + S - 1 ticks every micro-batch has crossed every stage; the bubble is (S-1)/(M+S-1) of the
ticks. Autodiff of the loop gives the backward (all micro-batches' activations are kept, as in
GPipe; combine with a remat policy). Tensor parallelism acts inside each stage unchanged, because
the strategy's constraints are batched with `spmd_axis_name="pipeline"`.

Circular (`circular`, `parallel.pipeline_repeats` = V): stage s holds the V chunks s, S+s, 2S+s, ...
of L/(S V) layers; each micro-batch goes round the ring V times (stage S-1 hands to stage 0: the same
roll, which wraps), so a tick runs L/(S V) layers and the pass takes V M + S - 1 ticks: the bubble
is (S-1)/(V M + S-1). It needs M >= S: micro-batch m's round v leaves stage S-1 at tick
v M + m + S - 1 and its round v+1 starts at stage 0 at tick (v+1) M + m, which must be later; the
output waits in between in a stage-local buffer [M, b, ...] (the size of GPipe's output buffer). The stored
[L, ...] stacks are split over `pipeline` in contiguous blocks (so checkpoints are the same for
every schedule), which the chunks are not: the circular layout moves the stage weights once per
pass, before the tick loop (one all-to-all over `pipeline` per weight, in its stored fsdp/tensor
split, of which (S-1)/S leaves the device), and their summed gradient once after it (pinned by
`pipeline_layout.on_stages`; left to GSPMD the gradient's reorder fell back to replicating it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from boost_jax.parallel.pipeline_layout import from_microbatches, to_microbatches


def ticks(stages: int, microbatches: int, repeats: int = 1) -> int:
    """Ticks of one pass: every micro-batch crosses every stage `repeats` times (V M items), the last
    one entering stage 0 at tick V M - 1 and leaving stage S-1 S-1 ticks later."""
    return repeats * microbatches + stages - 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The idle share of the stage-ticks: (S-1)/(V M + S-1) (gpipe: V = 1)."""
    return (stages - 1) / ticks(stages, microbatches, repeats)


@jax.custom_vjp
def shift_stages(x: jax.Array) -> jax.Array:
    """Stage s's output becomes stage s+1's input: a roll of the stage dim, one collective-permute.
    The custom VJP rolls the cotangent back the same way (one permute); autodiff of jnp.roll would
    transpose its slice + concatenate into two one-way permutes per tick."""
    return jnp.roll(x, 1, axis=0)


shift_stages.defvjp(lambda x: (shift_stages(x), None), lambda _, g: (jnp.roll(g, -1, axis=0),))


def _enter(micro, inputs, t, microbatches):
    """Micro-batch t enters stage 0 (after the bubble ticks the slot is never read again)."""
    stage_ids = jnp.arange(inputs.shape[0]).reshape((inputs.shape[0],) + (1,) * (micro.ndim - 1))
    entering = jax.lax.dynamic_index_in_dim(micro, jnp.minimum(t, microbatches - 1), keepdims=False)
    return jnp.where(stage_ids == 0, entering[None], inputs)


def gpipe(run_stages, staged, x, stages, microbatches, unroll, rows=None):
    """The schedule: `run_stages(staged, inputs [S, b, ...][, rows]) -> [S, b, ...]` runs every stage
    once; `rows` (per-row inputs, see pipeline.py `run`) move down the stages with their micro-batch."""
    micro = to_microbatches(x, microbatches)  # [M, b, ...]
    micro_rows = None if rows is None else jax.tree.map(lambda a: to_microbatches(a, microbatches), rows)

    def tick(carry, t):
        inputs, outputs, row_inputs = carry
        inputs = _enter(micro, inputs, t, microbatches)
        if rows is None:
            out = run_stages(staged, inputs)
        else:
            row_inputs = jax.tree.map(lambda m, i: _enter(m, i, t, microbatches), micro_rows, row_inputs)
            out = run_stages(staged, inputs, row_inputs)
            row_inputs = jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), row_inputs)  # integers: no gradient
        # Every stage files its output in its own row of `outputs` (stage-local, no traffic); the last
        # stage's row ends up holding micro-batch t-(S-1) at slot t-(S-1). Earlier ticks write slot 0,
        # overwritten later.
        done = jnp.maximum(t - (stages - 1), 0)
        outputs = jax.lax.dynamic_update_index_in_dim(outputs, out[:, None], done, 1)
        return (shift_stages(out), outputs, row_inputs), None

    inputs = jnp.zeros((stages,) + micro.shape[1:], x.dtype)
    outputs = jnp.zeros((stages,) + micro.shape, x.dtype)  # [S, M, b, ...]
    row_inputs = (
        None if rows is None else jax.tree.map(lambda m: jnp.zeros((stages,) + m.shape[1:], m.dtype), micro_rows)
    )
    (_, outputs, _), _ = jax.lax.scan(
        tick, (inputs, outputs, row_inputs), jnp.arange(microbatches + stages - 1), unroll=unroll
    )
    # One hand-over of the finished micro-batches from the last stage, instead of one per tick.
    outputs = outputs[stages - 1]
    return from_microbatches(outputs)


def circular(run_stages, staged, x, stages, microbatches, unroll, rows=None, *, repeats):
    """The circular (interleaved) schedule: `run_stages(staged, inputs [S, b, ...], chunk [S][, rows])`
    runs every stage once, stage s on its chunk `chunk[s]`. Item k = v M + m is micro-batch m's round
    v; stage s works on item t - s at tick t, so stage s-1's output of the last tick is its input and
    the ring wraps: stage 0 takes micro-batch t fresh for t < M, else micro-batch t mod M's output of
    round v-1 from stage S-1, which the shift hands to stage 0 at tick t - M + S - 1 <= t - 1 (M >= S)
    and stage 0 files in `loop` until it is read. After V M + S - 1 ticks `loop`'s stage-0 row holds
    every micro-batch's last round. Ticks outside 0 <= t - s < V M compute on stale inputs whose
    outputs are overwritten before they are read (zero cotangent)."""
    micro = to_microbatches(x, microbatches)  # [M, b, ...]
    micro_rows = None if rows is None else jax.tree.map(lambda a: to_microbatches(a, microbatches), rows)
    stage_ids = jnp.arange(stages)
    first = (stage_ids == 0).reshape((stages,) + (1,) * (micro.ndim - 1))

    def tick(carry, t):
        inputs, loop = carry
        item = t - stage_ids
        chunk = jnp.clip(item // microbatches, 0, repeats - 1)
        fresh = jax.lax.dynamic_index_in_dim(micro, jnp.minimum(t, microbatches - 1), keepdims=False)
        own = jax.lax.dynamic_index_in_dim(loop, t % microbatches, axis=1, keepdims=False)  # stage-local
        inputs = jnp.where(first, jnp.where(t < microbatches, fresh[None], own), inputs)
        if rows is None:
            out = run_stages(staged, inputs, chunk)
        else:  # every stage reads its micro-batch's rows where they are (the rows are not pipeline-split)
            out = run_stages(staged, inputs, chunk, jax.tree.map(lambda a: a[item % microbatches], micro_rows))
        out = shift_stages(out)
        # Stage 0 files what stage S-1 finished, item t - (S-1), under its micro-batch (every stage
        # writes its own row, no traffic; only row 0 is read).
        loop = jax.lax.dynamic_update_index_in_dim(loop, out[:, None], (t - (stages - 1)) % microbatches, 1)
        return (out, loop), None

    inputs = jnp.zeros((stages,) + micro.shape[1:], x.dtype)
    loop = jnp.zeros((stages,) + micro.shape, x.dtype)  # [S, M, b, ...]
    (_, loop), _ = jax.lax.scan(tick, (inputs, loop), jnp.arange(ticks(stages, microbatches, repeats)), unroll=unroll)
    return from_microbatches(loop[0])
