"""Linear kinds: what every projection of the model is, chosen by `model.linear`.

A kind is one module (a `LinearKind` subclass, see `base.py`) plus one entry here (or a `register`
call from anywhere, e.g. a test or a user's own package). The model, the strategies, online
RMSNorm, grouping, remat, the comm report and the planner reach kinds only through that interface
and this registry, so adding a kind changes nothing else. Entries may be import paths, so that
naming the kinds (config validation) imports no JAX.
"""
from __future__ import annotations

import importlib

REGISTRY: dict = {
    "dense": "boost_jax.model.kinds.dense:Dense",
    "lowrank": "boost_jax.model.kinds.lowrank:LowRank",
    "cola": "boost_jax.model.kinds.lowrank:CoLA",
    "tt": "boost_jax.model.kinds.tt:TensorTrain",
    "sltrain": "boost_jax.model.kinds.sltrain:SparseLowRank",
}


def register(name: str, kind) -> None:
    """Make `model.linear=name` build `kind` (a LinearKind subclass, or "module:Class")."""
    REGISTRY[name] = kind


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def kind_class(name: str):
    """The LinearKind subclass registered as `name`."""
    if name not in REGISTRY:
        from boost_jax.errors import ConfigError
        raise ConfigError(f"config field `model.linear`: {name!r} is not one of {names()}")
    entry = REGISTRY[name]
    if isinstance(entry, str):
        module, _, cls = entry.partition(":")
        return getattr(importlib.import_module(module), cls)
    return entry
