"""Train state and its shardings, built abstractly first so nothing is allocated before it is placed.

State is a plain pytree: params (a pure dict mirroring the model), optimizer state, step, rng.
`params` holds every model variable; its floating-point leaves are what is trained (`trainable`),
integer leaves are fixed arrays a linear kind keeps (e.g. a sparse support): saved, sharded and
restored like parameters, never differentiated or updated.
`logical_axes` reads the axis names each parameter declares (a leading `layers` axis is added for
the scanned stack), the strategy's rules turn them into PartitionSpecs, and the same shardings serve
init, the jitted train step and Orbax restore (so a checkpoint is resharded onto whatever mesh runs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.config import weights_cast_once
from boost_jax.model import model_from_config
from boost_jax.model.kinds import kind_class
from boost_jax.parallel.placement import Placement
from boost_jax.parallel.rules import spec_for


@dataclasses.dataclass
class StateSpec:
    graphdef: object  # the model's structure; merged with params inside the step
    abstract: dict  # ShapeDtypeStructs of the train state, with target shardings
    shardings: dict  # NamedShardings of the train state
    axes: dict  # logical axis names of every parameter
    pipeline: object = None  # the placement's pipeline schedule of the model (None: its layers scan)
    casts: dict | None = None  # per parameter, the dtype the train step casts it to once per step (`step_casts`)


def logical_axes(model) -> dict:
    flat = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        names = tuple(var.get_metadata().get("axes", ()))
        shape = var.get_value().shape
        if len(shape) == len(names) + 1:  # stacked by the layer vmap
            names = ("layers",) + names
        if len(names) != len(shape):
            raise ValueError(f"parameter {'/'.join(map(str, path))} has shape {shape} but axes {names}")
        flat[path] = names
    return _unflatten(flat)


def once_per_step(cfg) -> bool:
    """train.weight_casts: whether the step casts the weights once (`step`); `auto`: for the factored
    kinds over several micro-batches (with one, they are cast once anyway, and a scanned stack would
    hold the whole copy; a dense 7B's copy does not fit beside its TP-4 step on 40 GB GPUs:
    benchmarks/RESULTS.md, 2026-11-29 ninth session)."""
    return weights_cast_once(cfg.train.weight_casts, kind_class(cfg.model.linear).factored, cfg.train.grad_accum)


def step_casts(model, axes: dict, mesh, strategy, enabled: bool = True) -> dict | None:
    """Per parameter, the compute dtype the train step casts it to once per step, before its
    micro-batches (runtime/step.py), or None: cast where used, in every micro-batch. A parameter
    qualifies when the model declares it used only in the compute dtype (`compute_only` metadata:
    the GEMMs' matrices, the embedding; not the norm scales), is stored in another dtype, and is used
    in the layout it is stored in (not gathered over `fsdp`: its gradient's reduction there runs in
    `grad_reduce_dtype` before it reaches the copy, which would round it). Not under a pipeline or
    spatial-temporal GEMMs (their own schedules take the weights as stored). None when nothing
    qualifies or `enabled` is false (`once_per_step`)."""
    dtype = jnp.dtype(getattr(model, "dtype", jnp.float32))
    if not enabled or model.pipeline is not None or strategy.st_groups:
        return None
    flat = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        names, value = _at(axes, path), var.get_value()
        same = spec_for(names, value.shape, mesh, strategy.rules) == spec_for(
            names, value.shape, mesh, strategy.compute_rules
        )
        ok = var.get_metadata().get("compute_only", False) and value.dtype != dtype and same
        flat[path] = dtype.name if ok else None
    return _unflatten(flat) if any(flat.values()) else None


def _at(tree: dict, path: tuple):
    """The entry of a nested dict at `path`."""
    for key in path:
        tree = tree[key]
    return tree


def _unflatten(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def _is_trained(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def trainable(params, tree=None):
    """The leaves the optimizer updates (floating point), fixed integer leaves as None; with `tree`
    (shardings, specs: any tree with params' structure), `tree`'s entries at the trainable leaves."""
    return jax.tree.map(lambda p, x: x if _is_trained(p) else None, params, params if tree is None else tree)


def with_frozen(trained, params):
    """`trained`'s leaves, and `params`' fixed leaves where `trained` has None."""
    return jax.tree.map(lambda t, p: p if t is None else t, trained, params, is_leaf=lambda x: x is None)


def is_axes(x) -> bool:
    """A leaf of a logical-axes tree: a tuple of axis names (None for an unsharded dimension)."""
    return isinstance(x, tuple) and all(isinstance(n, (str, type(None))) for n in x)


def state_spec(cfg, tx, mesh, strategy) -> StateSpec:
    """The abstract train state on `mesh` under `strategy`; its graph definition is the model placed
    there (boost_jax/parallel/placement.py), so the steps built from it run that strategy."""
    model = nnx.eval_shape(lambda: model_from_config(cfg, Placement(mesh, strategy)))
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    axes = logical_axes(model)
    param_specs = jax.tree.map(
        lambda names, p: spec_for(names, p.shape, mesh, strategy.rules), axes, params, is_leaf=is_axes
    )
    opt_abstract = jax.eval_shape(tx.init, trainable(params))
    # Optimizer moments mirror their parameter's layout; scalars (counts) are replicated.
    opt_specs = optax.tree_map_params(
        tx,
        lambda _, spec: spec,
        opt_abstract,
        trainable(params, param_specs),
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )
    specs = {"params": param_specs, "opt_state": opt_specs, "step": P(), "rng": P()}
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    abstract_values = {
        "params": params,
        "opt_state": opt_abstract,
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32),
    }
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_values, shardings)
    casts = step_casts(model, axes, mesh, strategy, once_per_step(cfg))
    return StateSpec(graphdef, abstract, shardings, axes, model.pipeline, casts)


def init_state(cfg, tx, spec: StateSpec) -> dict:
    """Initialise parameters and optimizer state directly in their target shardings."""

    def init():
        model = model_from_config(cfg)
        params = nnx.to_pure_dict(nnx.state(model))
        return {
            "params": params,
            "opt_state": tx.init(trainable(params)),
            "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.key_data(jax.random.key(cfg.seed)).astype(jnp.uint32),
        }

    return jax.jit(init, out_shardings=spec.shardings)()
