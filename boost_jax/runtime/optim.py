"""AdamW with linear warmup, cosine decay to a floor, and global-norm clipping."""

from __future__ import annotations

import jax
import optax


def lr_schedule(t):
    warmup = max(int(t.warmup_steps), 1)  # at least one step (warmup 0 with steps 1 left no cosine step)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=t.lr,
        warmup_steps=warmup,
        decay_steps=max(int(t.steps), warmup + 1),
        end_value=t.lr * t.min_lr_ratio,
    )


def decay_mask(decay_norms: bool):
    """Every matrix (embedding, W, A, B, head) is decayed; the norm scales only with train.decay_norms
    (CoLA's official `AdamW(model.parameters(), weight_decay=0.01)` decays them too)."""
    if decay_norms:
        return None
    return lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) != "scale", params
    )


def make_optimizer(t):
    schedule = lr_schedule(t)
    tx = optax.chain(
        optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity(),
        optax.adamw(
            schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=decay_mask(bool(t.decay_norms))
        ),
    )
    return tx, schedule
