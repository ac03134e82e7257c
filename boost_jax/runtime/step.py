"""The train and eval steps: one compiled program each, bound to their mesh and strategy.

`make_train_step` and `make_eval_step` close over the mesh and strategy and trace the model under
that strategy's rules themselves (`bind`), so a step compiles to the same program wherever and
whenever it is traced: in the trainer, in a tool, in a test, inside or outside any `use_rules`.
`boost_jax/runtime/build.py` is the one place that builds them from a config.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from boost_jax.kernels import platform
from boost_jax.model import batch as batch_lib
from boost_jax.parallel.grad_reduce import accumulate_grads, accumulation_pieces
from boost_jax.parallel.pipeline.layout import to_microbatches
from boost_jax.parallel.rules import use_rules
from boost_jax.runtime.state import trainable, with_frozen


def next_token_loss(graphdef, params, batch, with_z_loss: bool = True):
    """Next-token cross-entropy (float32; boost_jax/model/loss.py): the mean of a stream batch
    (tokens [B, T+1]), the sum over the counted targets of a batch of documents (model/batch.py)."""
    return nnx.merge(graphdef, params).next_token_loss(batch, with_z_loss)


def bind(fn, mesh=None, strategy=None):
    """`fn` traced under `strategy`'s rules on `mesh` whatever rules are current (None: as given)."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def bound(*args, **kwargs):
        with use_rules(mesh, strategy), platform.target(mesh):
            return fn(*args, **kwargs)

    return bound


def make_train_step(graphdef, tx, schedule, mesh=None, strategy=None, param_specs=None, pipeline=None, casts=None):
    """The train step of the model `graphdef` on `mesh` under `strategy` (None: one device);
    `pipeline`: the model's pipeline schedule as its placement chose it (StateSpec.pipeline; None: its
    layers scan), which accumulates the gradient; `param_specs`: the parameters' PartitionSpecs (a
    pipeline's reordered stage weights keep them); `casts`: per parameter, the dtype it is cast to once
    per step, before the micro-batches (StateSpec.casts, runtime/state.py `step_casts`; None: none)."""

    def train_step(state, batch):
        """batch: [grad_accum, micro_batch, T+1] (or a batch of documents with those leading dims).
        Micro-batch gradients are summed by a loop so only one gradient buffer lives at a time; the
        update is skipped (params and optimizer state kept) if the loss or the gradient norm is not
        finite, and a weight the update would overflow keeps its value. A batch of documents is weighted by token:
        the loss is the
        mean over every counted target of the global batch, however they fall into micro-batches."""
        params = state["params"]
        trained = trainable(params)  # differentiated; fixed integer leaves ride along unchanged
        in_use = cast_once(trained, casts, mesh, param_specs)
        extra = {}
        if batch_lib.is_documents(batch):
            inputs, targets = batch_lib.counts(batch)
            scale = accumulation_pieces(batch, mesh, strategy) / jnp.maximum(targets, 1).astype(jnp.float32)
            loss_fn = lambda t, x: next_token_loss(graphdef, with_frozen(in_use(t), params), x) * scale  # noqa: E731
            extra = {"tokens": inputs, "targets": targets}
        else:
            loss_fn = lambda t, x: next_token_loss(graphdef, with_frozen(in_use(t), params), x)  # noqa: E731
        if pipeline is not None:
            # The stage weights' gradient over data x fsdp once per step (parallel/pipeline/stack.py).
            loss, grads = pipeline.accumulate(loss_fn, trained, batch, param_specs)
        else:
            # One reduction over `data` per step (parallel/grad_reduce.py), of the trainable leaves only.
            loss, grads = accumulate_grads(jax.value_and_grad(loss_fn), trained, batch, mesh, strategy)
        grad_norm, finite, kept, opt_state = optimizer_update(tx, grads, state["opt_state"], trained, loss)
        # A skipped step still counts (and consumed its batch), so step, checkpoint label and data
        # position stay one counter.
        new_state = {
            "params": with_frozen(kept, params),
            "opt_state": opt_state,
            "step": state["step"] + 1,
            "rng": state["rng"],
        }
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state["step"]), "finite": finite, **extra}
        return new_state, metrics

    return bind(train_step, mesh, strategy)


def cast_once(trained, casts, mesh=None, specs=None):
    """`t -> t` with each parameter `casts` names replaced by its copy in that dtype, made here, once
    (outside the accumulation loop, laid out as the parameter: `specs`), so no micro-batch casts it
    again; the gradient still flows to the parameter itself, in its own dtype (`_copy`), so the
    accumulation, its dtype and the optimizer are unchanged. Without `casts`: the identity."""
    if casts is None:
        return lambda t: t
    none = lambda x: x is None  # noqa: E731

    def copy(dtype, w, spec):
        if dtype is None or w is None:
            return None
        c = w.astype(dtype)
        return c if mesh is None or spec is None else jax.lax.with_sharding_constraint(c, NamedSharding(mesh, spec))

    copies = jax.tree.map(copy, casts, trained, casts if specs is None else specs, is_leaf=none)
    return lambda t: jax.tree.map(lambda c, w: w if c is None else _copy(w, c), copies, t, is_leaf=none)


@jax.custom_vjp
def _copy(w, copy):
    """`copy` (w in another dtype, made once per step) in w's place; the gradient goes to w, widened to
    w's dtype, as the cast it replaces would have sent it."""
    return copy


def _copy_fwd(w, copy):
    return copy, jnp.zeros((0,), w.dtype)


def _copy_bwd(like, g):
    return g.astype(like.dtype), None


_copy.defvjp(_copy_fwd, _copy_bwd)


def optimizer_update(tx, grads, opt_state, trained, loss):
    """(gradient norm, finite, the parameters kept, the optimizer state kept): one optimizer step,
    skipped (parameters and state kept as they were) when the loss or the gradient norm is not finite.
    That predicate is known before the update, so the choice between the new and the old state fuses
    into the optimizer's one pass over the parameters (a predicate read from the updated weights
    would take a second pass: benchmarks/RESULTS.md, "The optimizer in one pass"). Finite loss and gradients
    can still overflow a weight (a huge lr): such a weight keeps its value, checked element by element
    in the same pass, so the kept state is always finite."""
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_state = tx.update(grads, opt_state, trained)
    new_trained = optax.apply_updates(trained, updates)
    kept = jax.tree.map(lambda n, o: jnp.where(ok & jnp.isfinite(n), n, o), new_trained, trained)
    kept_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, opt_state)
    return grad_norm, ok, kept, kept_state


def make_eval_step(graphdef, microbatches: int = 1, mesh=None, strategy=None):
    """Cross-entropy (no z-loss) of a batch, run as `microbatches` sequential slices (as training
    runs its grad_accum micro-batches), so evaluation fits wherever training fits. A stream batch
    (tokens [B, T+1]) gives its mean; a batch of documents, or of stream rows with the rows that
    count (model/batch.py: what the evaluator passes), (sum over the counted targets, counted
    targets, input tokens that are not padding), each a [microbatches] vector, one entry per slice:
    the evaluator sums them over batches, or averages the slices' means as CoLA reports its loss."""

    def eval_step(params, batch):
        loss = lambda x: next_token_loss(graphdef, params, x, with_z_loss=False)  # noqa: E731
        if batch_lib.is_documents(batch):
            micro = jax.tree.map(lambda x: to_microbatches(x, microbatches), batch)
            sums = jax.lax.map(loss, micro) if microbatches > 1 else loss(batch)[None]
            per_slice = lambda mask: mask.sum(axis=(1, 2), dtype=jnp.int32)  # noqa: E731
            return sums, per_slice(batch_lib.target_mask(micro)), per_slice(batch_lib.input_mask(micro))
        if microbatches == 1:
            return loss(batch)
        micro = to_microbatches(batch, microbatches)  # each device keeps its rows
        return jax.lax.map(loss, micro).mean()

    return bind(eval_step, mesh, strategy)
