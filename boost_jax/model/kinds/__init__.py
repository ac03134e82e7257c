"""Linear kinds: what every projection of the model is, chosen by `model.linear`.

A kind is one module (a `LinearKind` subclass, see `base.py`) plus one entry here (or a `register`
call from anywhere, e.g. a test or a user's own package). The model, the strategies, online
RMSNorm, grouping, remat, the comm report, the planner and the Hugging Face export reach kinds only
through that interface and this registry, so adding a kind changes nothing else.

A kind's own hyperparameters are its class's `fields` ({name: config.Field(default, help)}):
registering the kind declares them as keys of the config's model section
(`boost_jax.config.declare_model_fields`), so the config schema names no kind. Entries may be import
paths, so that naming the kinds imports no JAX: such a kind's `fields` are read from its module's
source (a literal dict of Field(default, help) calls in the class body, or a base class's), and
checked against the class when it is first imported. `import boost_jax` imports this module, so the
built-in kinds' fields are in every `base_config()`.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

from boost_jax import config
from boost_jax.errors import ConfigError

REGISTRY: dict = {}
_DECLARED: dict = {}  # name -> the fields registered for it


def register(name: str, kind) -> None:
    """Make `model.linear=name` build `kind` (a LinearKind subclass, or "module:Class") and its
    `fields` keys of the model section."""
    fields = source_fields(kind) if isinstance(kind, str) else dict(kind.fields)
    config.declare_model_fields(name, fields)
    REGISTRY[name], _DECLARED[name] = kind, fields


def unregister(name: str) -> None:
    """Remove a kind and the fields only it declared (what a test that registered one does after)."""
    REGISTRY.pop(name)
    _DECLARED.pop(name, None)
    config.forget_model_fields(name)


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def kind_class(name: str):
    """The LinearKind subclass registered as `name`."""
    if name not in REGISTRY:
        raise ConfigError(f"config field `model.linear`: {name!r} is not one of {names()}")
    entry = REGISTRY[name]
    if not isinstance(entry, str):
        return entry
    module, _, cls = entry.partition(":")
    kind = getattr(importlib.import_module(module), cls)
    if dict(kind.fields) != _DECLARED[name]:
        raise TypeError(
            f"linear kind {name} ({entry}): its `fields` are not the literal dict of "
            f"Field(default, help) that registering it read from the source ({_DECLARED[name]})"
        )
    return kind


def source_fields(entry: str) -> dict:
    """The `fields` of class "module:Class", read from the source without importing it: the literal
    `fields = {NAME: Field(DEFAULT, HELP), ...}` of its class body, else of its first base class that
    has one (in that module or imported by name from another); {} when none does."""
    module, _, cls = entry.partition(":")
    origin = importlib.util.find_spec(module).origin
    tree = ast.parse(Path(origin).read_text(), origin)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    imported = {
        a.asname or a.name: f"{n.module}:{a.name}"
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and n.module
        for a in n.names
    }
    if cls not in classes:
        return source_fields(imported[cls]) if cls in imported else {}
    for stmt in classes[cls].body:
        target = (
            stmt.targets[0]
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            else getattr(stmt, "target", None)
            if isinstance(stmt, ast.AnnAssign)
            else None
        )
        if isinstance(target, ast.Name) and target.id == "fields" and stmt.value is not None:
            return {
                ast.literal_eval(k): config.Field(*map(ast.literal_eval, v.args))
                for k, v in zip(stmt.value.keys, stmt.value.values)
            }
    for base in classes[cls].bases:
        if isinstance(base, ast.Name):
            found = source_fields(f"{module}:{base.id}")
            if found:
                return found
    return {}


for _name, _entry in {
    "dense": "boost_jax.model.kinds.dense:Dense",
    "lowrank": "boost_jax.model.kinds.lowrank:LowRank",
    "cola": "boost_jax.model.kinds.lowrank:CoLA",
    "tt": "boost_jax.model.kinds.tt:TensorTrain",
    "sltrain": "boost_jax.model.kinds.sltrain:SparseLowRank",
}.items():
    register(_name, _entry)
