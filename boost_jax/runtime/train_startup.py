"""What the trainer settles before its loop (boost_jax/train.py): its start-up line, the data it
reads (this process's rows, in the order a resumed run's position refers to, checked against the
checkpoint's record), what each evaluation reads, an interrupted final evaluation, the compilation
cache."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.data import build_loaders, changed_sources
from boost_jax.data.mapped import mapped_since, mark
from boost_jax.errors import ConfigError
from boost_jax.model import autos
from boost_jax.model.kinds import kind_class
from boost_jax.parallel.mesh import BATCH_AXES
from boost_jax.runtime.checkpoints.store import Checkpointer
from boost_jax.runtime.evaluation import plan_eval


def startup_line(cfg, built, config_file: str, planned=None) -> str:
    """One line: the model, its parameters, the devices and mesh, the strategy, the batching, the config."""
    params = sum(
        math.prod(x.shape)
        for x in jax.tree.leaves(built.spec.abstract["params"])
        if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
    )
    m, t, p = cfg.model, cfg.train, cfg.parallel
    mesh = "x".join(f"{k} {v}" for k, v in built.mesh.shape.items() if v > 1) or "one device"
    devices = built.mesh.devices.size
    auto = f" (auto: {autos.describe(built.autos)})" if built.autos else ""
    return (
        f"{cfg.name}: {m.linear} model, {params / 1e6:.2f}M parameters (d {m.d_model}, {m.n_layers} layers"
        f"{f', rank {m.rank}' if kind_class(m.linear).factored else ''}); {devices} {jax.default_backend()} device"
        f"{'s' if devices > 1 else ''}, mesh {mesh}{' (parallel.plan=auto)' if planned else ''}, strategy "
        f"{p.strategy}{auto}; batch {t.global_batch} x "
        f"{t.seq_len} ({cfg.data.batching}, grad_accum {t.grad_accum}), {t.steps} steps; config "
        f"{config_file or 'given as a ConfigDict'}"
    )


def complete_line(cfg, step: int, ckpt: Checkpointer) -> str:
    """What a rerun of a run that already reached its last (or its stop_at_step) step says."""
    t = cfg.train
    if step >= t.steps:
        return (
            f"the run is complete: step {step} of {t.steps} is saved in {ckpt.directory}; nothing to train "
            "(raise --config.train.steps to train on, or choose a new --config.run_dir)"
        )
    return (
        f"the run is at step {step}, at or past --config.train.stop_at_step={t.stop_at_step} (of "
        f"{t.steps}); nothing to train (raise or drop train.stop_at_step to continue)"
    )


def data_order(cfg, meta: dict, say) -> str:
    """The permutation that orders the train data: data.shuffle, or for a resumed run the one its
    checkpoint's position refers to (checkpoints written before data.shuffle existed: numpy)."""
    if not meta:
        return cfg.data.shuffle
    used = meta.get("data_shuffle", "numpy")
    if used != cfg.data.shuffle:
        say(
            f"note: the checkpoint's data position was reached with data.shuffle={used}; continuing with it "
            f"(data.shuffle={cfg.data.shuffle} applies to new runs)"
        )
    return used


def check_data(cfg, meta: dict, data, say) -> list[str]:
    """A resumed run's data must be what its checkpoint's position refers to (data.allow_changed=true
    continues on changed data, saying so); returns what changed."""
    recorded = meta.get("data_identity")
    if not recorded:  # a fresh run, or a checkpoint written before data identities were recorded
        return []
    changed = changed_sources(recorded, data.identity)
    if changed and not cfg.data.allow_changed:
        raise ConfigError(
            f"config field `data.allow_changed`: the data changed since the checkpoint was written "
            f"({', '.join(changed)}), so its data position (sample {meta['data_position']:,}) would "
            "read other batches; restore the data it trained on, or set data.allow_changed=true to "
            "continue on the new data from that position"
        )
    if changed:
        say(
            f"note: the data changed since the checkpoint ({', '.join(changed)}); continuing on the new data "
            "from the same position (data.allow_changed=true)"
        )
    return changed


def load_data(cfg, built, order: str):
    """(train loader, eval loader) of this process's rows, the train samples in `order`; the train
    loader records the token files it maps (checked at log and save points)."""
    before = mark()
    train_data, eval_data, _ = build_loaders(cfg, *batch_slice(built.mesh, cfg.train.global_batch), order=order)
    train_data.mapped = mapped_since(before)  # the token files this run reads, with their sizes
    return train_data, eval_data


def batch_slice(mesh, global_batch: int) -> tuple[int, int]:
    """(index, count) of the slice of the global batch this process feeds. Processes whose devices
    hold the same rows (a tensor or pipeline axis spanning processes) must load the same rows."""
    shards = NamedSharding(mesh, P(BATCH_AXES)).addressable_devices_indices_map((global_batch,))
    lo = min(idx[0].start or 0 for idx in shards.values())
    hi = max(global_batch if idx[0].stop is None else idx[0].stop for idx in shards.values())
    return lo // (hi - lo), global_batch // (hi - lo)


def eval_plan(cfg, eval_data, say):
    """What each evaluation reads (runtime/evaluation.py plan_eval), settled at start-up: a token
    budget the held-out split cannot meet is a ConfigError now, not after compiling; a split smaller
    than train.eval_batches batches is read whole, once, and said so here. None: no evaluation."""
    if not cfg.train.eval_every:
        return None
    reading = plan_eval(cfg, eval_data)
    if reading.note:
        say(reading.note)
    return reading


def final_eval_cut(meta: dict, run_dir: Path, step: int) -> bool:
    """Whether the checkpoint a finished run resumed from says that its step's evaluation was stopped
    (a signal during the final evaluation) and no later start ran it (metrics.jsonl: an eval_loss row
    of that step after its last eval_stopped row). Every process gets process 0's answer."""
    if not meta.get("eval_stopped"):
        return False
    cut = True
    if jax.process_index() == 0:
        try:
            with open(run_dir / "metrics.jsonl") as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if row.get("step") == step and ("eval_loss" in row or "eval_stopped" in row):
                        cut = "eval_stopped" in row
        except OSError:
            pass
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        cut = bool(multihost_utils.broadcast_one_to_all(np.int32(cut)))
    return cut


def use_compile_cache(directory: str) -> None:
    """Point JAX's persistent compilation cache at `directory` (created if missing); "" leaves it."""
    if not directory:
        return
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = Path(directory).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"config field `compile_cache`: cannot create {path} ({e.strerror or e}); "
            'choose a writable directory or "" for no cache'
        ) from e
    if jax.config.jax_compilation_cache_dir != str(path):
        cc.set_cache_dir(str(path))
        cc.reset_cache()  # JAX decides once whether to use a cache: ask again with the new directory
