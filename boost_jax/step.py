"""The jitted train and eval steps (one compiled program each, state donated)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.parallel.mesh import BATCH_AXES
from boost_jax.state import trainable, with_frozen


def cross_entropy(logits, labels):
    """Mean cross-entropy that stays vocab-parallel: only reductions over the vocab axis (max, sum,
    and the label's logit picked by comparison with an iota), so sharded logits are never gathered."""
    top = jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))
    lse = jnp.log(jnp.exp(logits - top).sum(axis=-1)) + top[..., 0]
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    picked = jnp.where(vocab == labels[..., None], logits, 0.0).sum(axis=-1)
    return (lse - picked).mean()


def next_token_loss(graphdef, params, tokens):
    """Mean next-token cross-entropy of tokens [B, T+1] (float32)."""
    model = nnx.merge(graphdef, params)
    logits, _ = model(tokens[:, :-1])
    return cross_entropy(logits, tokens[:, 1:])


def make_train_step(graphdef, tx, schedule):
    # Differentiate the trainable leaves only; fixed integer leaves ride along unchanged.
    grad_fn = jax.value_and_grad(lambda t, p, x: next_token_loss(graphdef, with_frozen(t, p), x))

    def train_step(state, batch):
        """batch: [grad_accum, micro_batch, T+1]. Micro-batch gradients are summed by a scan so only
        one gradient buffer lives at a time; the update is skipped (params and optimizer state kept) if
        the loss, the gradient norm or any updated parameter is not finite."""
        params = state["params"]
        trained = trainable(params)
        if batch.shape[0] == 1:
            loss, grads = grad_fn(trained, params, batch[0])
        else:
            def micro(acc, tokens):
                l, g = grad_fn(trained, params, tokens)
                return jax.tree.map(jnp.add, acc, g), l

            zeros = jax.tree.map(jnp.zeros_like, trained)
            grads, losses = jax.lax.scan(micro, zeros, batch)
            grads = jax.tree.map(lambda g: g / batch.shape[0], grads)
            loss = losses.mean()
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], trained)
        new_trained = optax.apply_updates(trained, updates)
        new_params = with_frozen(new_trained, params)
        # Finite loss and gradients can still overflow the weights (a huge lr): check what is kept.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.all(
            jnp.stack([jnp.isfinite(p).all() for p in jax.tree.leaves(new_trained)]))
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        # A skipped step still counts (and consumed its batch), so step, checkpoint label and data
        # position stay one counter.
        new_state = {"params": keep(new_params, params), "opt_state": keep(opt_state, state["opt_state"]),
                     "step": state["step"] + 1, "rng": state["rng"]}
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state["step"]), "finite": finite}
        return new_state, metrics

    return train_step


def make_eval_step(graphdef):
    def eval_step(params, tokens):
        return next_token_loss(graphdef, params, tokens)

    return eval_step


def jit_train_step(spec, tx, schedule, mesh):
    """(the jitted train step, the sharding of its [grad_accum, micro_batch, T+1] batch).

    The trainer runs it and the tools lower it, so what the tools report is what runs."""
    batch_sharding = NamedSharding(mesh, P(None, BATCH_AXES))
    step = jax.jit(make_train_step(spec.graphdef, tx, schedule), donate_argnums=0,
                   in_shardings=(spec.shardings, batch_sharding), out_shardings=(spec.shardings, None))
    return step, batch_sharding
