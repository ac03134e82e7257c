"""The programs tools/comm_report/ reads: each strategy column's config, and the trainer's steps
(forward loss, forward+backward, train step) compiled from abstract shapes at a given depth."""

from __future__ import annotations

import math
import time

from boost_jax.model import kinds
from boost_jax.model.kinds import kind_class
from boost_jax.tools.hlo_comm import compile_partitioned
from boost_jax.validate import validate


def parse_strategies(text) -> list[tuple[str, str | None]]:
    """'btp,megatron:cola' -> [('btp', None), ('megatron', 'cola')]; None: the default linear.
    Names come from the strategy and linear-kind registries; text None: every registered strategy."""
    from boost_jax.parallel import strategies  # lazy: loads JAX; the callers set the emulated devices first

    text = strategies.names() if text is None else text
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        name, _, linear = item.strip().partition(":")
        if name not in strategies.names():
            raise SystemExit(f"--strategy: {name!r} is not one of {strategies.names()}")
        if linear and linear not in kinds.names():
            raise SystemExit(f"--strategy: {item!r}: the part after ':' must be one of {kinds.names()}")
        out.append((name, linear or None))
    return out


def variant_config(
    base,
    strategy: str,
    linear: str | None,
    mesh,
    batch: int,
    seq: int,
    dtype: str,
    remat: str | None = None,
    context: int = 1,
):
    """The config one strategy column is measured on (depth and unrolling are set per compile);
    mesh = (data, fsdp, tensor), `context` the sequence split."""
    from boost_jax.parallel.strategies import registered  # lazy: loads JAX; the callers set the emulated devices first

    c = base.copy_and_resolve_references()
    linear = linear or registered(strategy).report_linear or c.model.linear
    if linear != c.model.linear:  # the twin: same shapes, other projection kind (cola_7b <-> llama_7b)
        was, kind = kind_class(c.model.linear), kind_class(linear)
        if was.family and kind.family and c.name.startswith(was.family + "_"):
            c.name = kind.family + c.name[len(was.family) :]
        c.model.linear = linear
        c.model.only_lr_act = c.model.only_lr_act and kind.nonlinear(c.model)
    c.model.dtype = dtype
    c.remat.policy = remat or c.remat.policy
    c.model.max_seq_len = max(c.model.max_seq_len, seq)
    c.train.update(seq_len=seq, global_batch=batch, grad_accum=1)
    data, fsdp, tensor = mesh
    c.parallel.update(
        data=data, fsdp=fsdp, tensor=tensor, context=context, num_devices=math.prod(mesh) * context, strategy=strategy
    )
    c.data.source = "embedded"  # nothing is read; a zoo config's `tokens` source would need a path
    return validate(c)


def compile_program(cfg, program: str, devices, n_layers: int, unroll: bool, partitioned: bool = False):
    """(compiled, mesh, seconds) for one program at one depth, from abstract shapes only (the runtime's
    builder: the trainer's own steps); with `partitioned`, also its HLO right after SPMD partitioning
    (collectives in their logical dtypes)."""
    import jax

    from boost_jax.runtime.build import build  # lazy: loads JAX; the callers set the emulated devices first
    from boost_jax.runtime.state import trainable, with_frozen  # lazy: loads JAX (as above)

    cfg = cfg.copy_and_resolve_references()
    cfg.model.n_layers, cfg.model.scan_unroll = n_layers, unroll
    start = time.perf_counter()
    built = build(cfg, devices)
    spec, batch = built.spec, built.abstract_batch()
    if program == "train_step":
        lowered = built.lower_train()
    else:
        loss = built.loss_fn()

        # Gradients come out in the parameters' layout, as the optimizer receives them.
        def grads(params, b):  # of the trainable leaves, as in the train step
            return jax.grad(lambda t: loss(with_frozen(t, params), first(b)))(trainable(params))

        first = lambda b: jax.tree.map(lambda x: x[0], b)  # noqa: E731 - one micro-batch
        fn = (
            jax.jit(lambda params, b: loss(params, first(b)))
            if program == "forward"
            else jax.jit(grads, out_shardings=trainable(spec.abstract["params"], spec.shardings["params"]))
        )
        lowered = fn.lower(spec.abstract["params"], batch)
    if partitioned:
        compiled, text = compile_partitioned(lowered)
        return compiled, built.mesh, time.perf_counter() - start, text
    return lowered.compile(), built.mesh, time.perf_counter() - start


def cost_flops(compiled) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float(cost.get("flops", 0.0)) if cost else None


def memory_breakdown(compiled) -> dict | None:
    """A compiled program's memory_analysis() per device: arguments, outputs, temporaries, aliased
    (donated) bytes and their total, the peak; None where the backend reports none."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    arg, out, temp = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
    alias = m.alias_size_in_bytes  # donated state: its outputs reuse the argument buffers
    return {
        "argument_bytes": arg,
        "output_bytes": out,
        "temp_bytes": temp,
        "alias_bytes": alias,
        "total_bytes": arg + out + temp - alias,
    }
