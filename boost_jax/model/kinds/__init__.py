"""Linear kinds: what every projection of the model is, chosen by `model.linear`.

A kind is one module (a `LinearKind` subclass, see `base.py`) plus one entry here. The model,
the strategies, online RMSNorm, grouping, remat and the planner reach kinds only through that
interface, so adding a kind changes nothing else. Entries are import paths so that naming the kinds
(config validation) imports no JAX.
"""
from __future__ import annotations

import importlib

REGISTRY = {
    "dense": "boost_jax.model.kinds.dense:Dense",
    "lowrank": "boost_jax.model.kinds.lowrank:LowRank",
    "cola": "boost_jax.model.kinds.lowrank:CoLA",
    "tt": "boost_jax.model.kinds.tt:TensorTrain",
    "sltrain": "boost_jax.model.kinds.sltrain:SparseLowRank",
}
NAMES = tuple(REGISTRY)


def kind_class(name: str):
    """The LinearKind subclass registered as `name`."""
    if name not in REGISTRY:
        raise ValueError(f"config field `model.linear`: {name!r} is not one of {NAMES}")
    module, _, cls = REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), cls)
