"""Validation that needs the registries: each is asked about its own part of a run config.

`config.check_fields` checks plain values; here the linear kinds, attention implementations,
strategies, data sources, norm kernels and remat policies check their names (each registry is the
one source of them), a kind checks its own fields, and `check_mesh` derives what a mesh must divide
from the strategy's rule table and the logical axes the model and its kinds declare. Errors are
`ConfigError`s naming the field. This module sits above the model, parallel and data layers and
below the runtime, whose builder calls both functions.
"""

from __future__ import annotations

from boost_jax import config as config_lib
from boost_jax import data
from boost_jax.config import check
from boost_jax.errors import ConfigError
from boost_jax.model import kinds


def _one_of(value, names, field: str) -> None:
    check(value in names, field, f"{value!r} is not one of {tuple(names)}")


def validate(c):
    """Reject configurations that cannot build, naming the field and what would work; returns c.
    Every problem found is reported at once (one ConfigError, a line each: config.every_problem);
    a check that needs another field to be right first runs once that one is."""
    from boost_jax.kernels import rmsnorm  # lazy: loads JAX (tools set XLA_FLAGS first)
    from boost_jax.model import attention, remat  # lazy: loads JAX (tools set XLA_FLAGS first)
    from boost_jax.model.transformer import projection_widths  # lazy: loads JAX (tools set XLA_FLAGS first)
    from boost_jax.parallel import strategies  # lazy: loads JAX (tools set XLA_FLAGS first)

    m, p = c.model, c.parallel
    with config_lib.every_problem():
        known = {
            "linear": m.linear in kinds.names(),
            "attention": m.attention in attention.names(),
            "strategy": p.strategy in strategies.names(),
        }
        _one_of(m.linear, kinds.names(), "model.linear")
        with config_lib.part():
            config_lib.check_fields(c)
        if known["linear"]:
            with config_lib.part():
                problem = kinds.kind_class(m.linear).validate(m, projection_widths(m))
                if problem:
                    field, _, message = problem.partition(": ")
                    raise ConfigError(f"config field `{field}`: {message}")
        _one_of(m.attention, attention.names(), "model.attention")
        _one_of(m.logits_dtype, ("compute", "float32"), "model.logits_dtype")
        _one_of(c.remat.policy, ("auto",) + remat.POLICIES, "remat.policy")
        check(
            m.group_linears in ("auto", True, False, "first"),
            "model.group_linears",
            f"{m.group_linears!r} is not auto, true, false or first",
        )
        check(
            m.scan_unroll in ("auto", True, False), "model.scan_unroll", f"{m.scan_unroll!r} is not auto, true or false"
        )
        _one_of(c.data.source, data.SOURCES, "data.source")
        _one_of(p.strategy, strategies.names(), "parallel.strategy")
        _one_of(c.kernels.rmsnorm, ("auto",) + tuple(rmsnorm.IMPLS), "kernels.rmsnorm")
        _one_of(c.kernels.residual_norm, ("auto", "fused", "separate"), "kernels.residual_norm")
        with config_lib.part():
            strategies.st_groups(p.linear_partition)
        if known["attention"]:
            with config_lib.part():
                _check_documents(c, attention)
        if all(known.values()):
            with config_lib.part():
                _check_context(c, attention, kinds)
        if c.data.source != "embedded":
            for field, spec in (("data.path", c.data.path), ("data.eval_path", c.data.eval_path)):
                with config_lib.part():
                    try:
                        data.parse_mixture(spec, field) if spec else None
                    except ValueError as e:
                        raise ConfigError(str(e)) from None
    return c


def _check_documents(c, attention) -> None:
    """data.batching packed/document: the attention implementation must take document masks."""
    batching = c.data.batching
    if batching == "stream":
        return
    kind = "segments" if batching == "packed" else "lengths"  # (Documents.kind of such rows)
    ok = lambda name: attention.masks(name, kind)  # noqa: E731
    check(
        ok(c.model.attention),
        "model.attention",
        f"{c.model.attention} cannot keep attention inside documents (data.batching={batching}); use one of "
        f"{tuple(n for n in attention.names() if ok(n))}",
    )


def _check_context(c, attention, kinds) -> None:
    """parallel.context > 1: an attention implementation with a block form. parallel.context_kv=
    bottleneck, whatever the context size (a setting that cannot work is refused even where it has
    nothing to do yet): a factored kind whose projections are B·σ(A x) alone, and B's that keep whole heads."""
    p = c.parallel
    check(
        p.context == 1 or attention.takes_context(c.model.attention),
        "model.attention",
        f"{c.model.attention} cannot run with the sequence split over parallel.context={p.context}; use one of "
        f"{tuple(n for n in attention.names() if attention.takes_context(n))}",
    )
    if p.context_kv != "bottleneck":
        return
    kind = kinds.kind_class(c.model.linear)
    check(
        kind.factored and not kind.has_extra,
        "parallel.context_kv",
        f"bottleneck passes the r-wide σ(A x) of a factored projection, but model.linear={c.model.linear} "
        + ("has no bottleneck" if not kind.factored else "adds a full-width term (S·x) to it")
        + "; use parallel.context_kv=full",
    )
    from boost_jax.parallel import strategies  # lazy: loads JAX (tools set XLA_FLAGS first)

    whole = [n for n in strategies.names() if strategies.registered(n).keeps_whole_rank]
    check(
        strategies.registered(p.strategy).keeps_whole_rank,
        "parallel.context_kv",
        f"bottleneck rebuilds K/V with each device's B's, which parallel.strategy={p.strategy} splits along the "
        f"rank; use parallel.strategy {' or '.join(whole)}, or parallel.context_kv=full",
    )


def check_mesh(cfg, mesh) -> None:
    """What `mesh` must divide for this model under cfg's strategy: every logical axis the strategy
    splits over `tensor` (its rule table) in whole units (the model's and its kind's axes), the
    spatial-temporal grid's widths, the batch and the pipeline."""
    from boost_jax.model.transformer import axis_units, projection_widths  # lazy: loads JAX (tools set XLA_FLAGS first)
    from boost_jax.parallel import mesh as mesh_lib  # lazy: loads JAX (tools set XLA_FLAGS first)
    from boost_jax.parallel.strategies import get_strategy  # lazy: loads JAX (tools set XLA_FLAGS first)

    m, sizes = cfg.model, dict(mesh.shape)
    strategy = get_strategy(cfg.parallel)
    mesh_lib.check_tensor_split(strategy.rules, sizes["tensor"], axis_units(m))
    if strategy.st_groups:
        widths = projection_widths(m)
        if kinds.kind_class(m.linear).factored:
            widths["model.rank"] = int(m.rank)
        mesh_lib.check_grid(sizes, widths)
    mesh_lib.check_batch(cfg, sizes)
    mesh_lib.check_context(cfg, sizes)
