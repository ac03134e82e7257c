"""A checkpoint saved on one mesh and strategy restores bit for bit onto any other (Orbax reads each
array into the target sharding), and its parameters alone restore without the optimizer state."""

import jax
import numpy as np
import pytest

from boost_jax import train
from boost_jax.runtime.build import build
from boost_jax.runtime.checkpoints.store import Checkpointer, read_run, restore

# Heads 8 so tensor=8 divides them; saved on (data, fsdp, tensor) = (1, 1, 8) with btp.
SAVED = {
    "model.n_heads": 8,
    "model.n_kv_heads": 8,
    "parallel.data": 1,
    "parallel.tensor": 8,
    "parallel.strategy": "btp",
    "train.steps": 2,
    "checkpoint.every": 2,
    "train.eval_every": 0,
}
TARGETS = {  # name: (parallel.* of the target, devices)
    "(2,2,2) vanilla": (dict(data=2, fsdp=2, tensor=2, strategy="vanilla"), 8),
    "(2,1,4) megatron": (dict(data=2, fsdp=1, tensor=4, strategy="megatron"), 8),
    # Spatial-temporal groups keep the strategy's stored layout (they skew at use): nothing to convert.
    "(2,2,2) btp st": (dict(data=2, fsdp=2, tensor=2, strategy="btp", linear_partition="st"), 8),
    "one device": (dict(data=1, fsdp=1, tensor=1, strategy="btp"), 1),
}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    from conftest import small_config

    run_dir = tmp_path_factory.mktemp("reshard") / "run"
    train.run(small_config(run_dir, **SAVED))
    return run_dir


def _spec(cfg, parallel: dict, n_devices: int):
    cfg = cfg.copy_and_resolve_references()
    cfg.parallel.update(parallel)
    return build(cfg, jax.devices()[:n_devices]).spec


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("target", list(TARGETS))
def test_restore_onto_another_mesh_is_bit_exact(saved_run, target):
    cfg, root, step = read_run(str(saved_run))
    ckpt = Checkpointer(root, keep=3, create=False)
    saved, _ = ckpt.restore(step, _spec(cfg, {}, 8).abstract)  # as saved: (1,1,8) btp
    parallel, n = TARGETS[target]
    spec = _spec(cfg, parallel, n)
    state, meta = ckpt.restore(step, spec.abstract)
    ckpt.close()
    assert meta["step"] == step == 2
    # Every array lands in the target layout ...
    for leaf, want in zip(jax.tree.leaves(state), jax.tree.leaves(spec.shardings)):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
    # ... with the saved values, bit for bit (params and optimizer moments alike).
    for a, b in zip(_host(saved), _host(state)):
        np.testing.assert_array_equal(a, b)


def test_params_only_restore(saved_run):
    cfg, root, step = read_run(str(saved_run))
    ckpt = Checkpointer(root, keep=3, create=False)
    saved, _ = ckpt.restore(step, _spec(cfg, {}, 8).abstract)
    ckpt.close()
    spec = _spec(cfg, TARGETS["(2,2,2) vanilla"][0], 8)
    params = restore(str(root), {"params": spec.abstract["params"]}, step=step).state["params"]
    assert jax.tree.structure(params) == jax.tree.structure(saved["params"])
    for a, b in zip(_host(saved["params"]), _host(params)):
        np.testing.assert_array_equal(a, b)
