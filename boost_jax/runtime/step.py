"""The jitted train and eval steps (one compiled program each, state donated)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.parallel.grad_reduce import accumulate_grads
from boost_jax.parallel.mesh import BATCH_AXES
from boost_jax.parallel.pipeline import to_microbatches
from boost_jax.runtime.state import trainable, with_frozen


def next_token_loss(graphdef, params, tokens, with_z_loss: bool = True):
    """Mean next-token cross-entropy of tokens [B, T+1] (float32; boost_jax/model/loss.py)."""
    return nnx.merge(graphdef, params).next_token_loss(tokens, with_z_loss)


def make_train_step(graphdef, tx, schedule):
    # Differentiate the trainable leaves only; fixed integer leaves ride along unchanged.
    grad_fn = jax.value_and_grad(lambda t, p, x: next_token_loss(graphdef, with_frozen(t, p), x))

    def train_step(state, batch):
        """batch: [grad_accum, micro_batch, T+1]. Micro-batch gradients are summed by a scan so only
        one gradient buffer lives at a time; the update is skipped (params and optimizer state kept) if
        the loss, the gradient norm or any updated parameter is not finite."""
        params = state["params"]
        trained = trainable(params)
        # One reduction over `data` per step (parallel/grad_reduce.py), of the trainable leaves only.
        loss, grads = accumulate_grads(lambda t, x: grad_fn(t, params, x), trained, batch)
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


def make_eval_step(graphdef, microbatches: int = 1):
    """Mean cross-entropy (no z-loss) of tokens [B, T+1], run as `microbatches` sequential slices
    (as training runs its grad_accum micro-batches), so evaluation fits wherever training fits."""
    def eval_step(params, tokens):
        if microbatches == 1:
            return next_token_loss(graphdef, params, tokens, with_z_loss=False)
        micro = to_microbatches(tokens, microbatches)  # each device keeps its rows
        return jax.lax.map(lambda x: next_token_loss(graphdef, params, x, with_z_loss=False), micro).mean()

    return eval_step


def jit_train_step(spec, tx, schedule, mesh):
    """(the jitted train step, the sharding of its [grad_accum, micro_batch, T+1] batch).

    The trainer runs it and the tools lower it, so what the tools report is what runs."""
    batch_sharding = NamedSharding(mesh, P(None, BATCH_AXES))
    step = jax.jit(make_train_step(spec.graphdef, tx, schedule), donate_argnums=0,
                   in_shardings=(spec.shardings, batch_sharding), out_shardings=(spec.shardings, None))
    return step, batch_sharding



def lower_train_step(cfg, devices=None):
    """(the lowered train step, its batch sharding, the state spec, the mesh) for `cfg`, from abstract
    shapes only (nothing is allocated): what benchmarks and tests compile to read the program."""
    from boost_jax.runtime.optim import make_optimizer
    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.rules import use_rules
    from boost_jax.parallel.strategies import get_strategy
    from boost_jax.runtime.state import state_spec

    tx, schedule = make_optimizer(cfg.train)
    mesh, strategy = make_mesh(cfg, devices), get_strategy(cfg.parallel)
    with use_rules(mesh, strategy):  # the model's sharding constraints read it while tracing
        spec = state_spec(cfg, tx, mesh, strategy)
        step, batch_sharding = jit_train_step(spec, tx, schedule, mesh)
        t = cfg.train
        batch = jax.ShapeDtypeStruct((t.grad_accum, t.global_batch // t.grad_accum, t.seq_len + 1), jnp.int32,
                                     sharding=batch_sharding)
        return step.lower(spec.abstract, batch), batch_sharding, spec, mesh