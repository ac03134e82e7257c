"""The device mesh: named axes (pipeline, data, fsdp, context, tensor) sized from `parallel.*`, one inferable;
and what a mesh must divide, derived from the strategy's rule table.

Nothing here knows the model: the caller (boost_jax/validate.py) says how many whole units each
logical axis holds (`units`: heads, not head columns; the MLP width; the rank of a factored kind)
and which widths a projection has; the rule table says which logical axes the tensor axis splits.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from boost_jax.errors import ConfigError
from boost_jax.parallel.rules import as_tuple

# Outermost first: pipeline stages may span nodes; `context` (the sequence split) sits inside the batch
# axes and outside `tensor`, whose collectives are the most frequent.
AXES = ("pipeline", "data", "fsdp", "context", "tensor")
BATCH_AXES = ("data", "fsdp")  # the global batch is split over both
# `parallel` settings that put a run (any mesh, any partition) on a single device.
# parallel.* of one device (a pipeline schedule needs stages: one device runs the layers in order).
ONE_DEVICE = dict(
    pipeline=1,
    data=1,
    fsdp=1,
    context=1,
    tensor=1,
    num_devices=0,
    linear_partition="",
    pipeline_schedule="gpipe",
    pipeline_repeats=1,
)


def mesh_shape(p, n_devices: int, platform: str = "") -> tuple[int, ...]:
    """The mesh's axis sizes on `n_devices` devices (one axis may be -1: inferred). `platform`: the
    devices' platform, for the error's hint on emulating more CPU devices."""
    sizes = [int(p[a]) for a in AXES]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise ConfigError(
                f"config field `parallel`: {dict(zip(AXES, sizes))} cannot be completed to "
                f"{n_devices} devices ({known} does not divide {n_devices})"
            )
        sizes[sizes.index(-1)] = n_devices // known
    if math.prod(sizes) != n_devices:
        want = math.prod(sizes)
        emulate = (
            (
                f", or emulate {want} CPU devices by starting the command with XLA_FLAGS="
                f"--xla_force_host_platform_device_count={want}"
            )
            if platform == "cpu" and want > n_devices
            else ""
        )
        raise ConfigError(
            f"config field `parallel`: pipeline*data*fsdp*context*tensor = {want} but JAX sees "
            f"{n_devices} device{'s' if n_devices != 1 else ''}; set one of parallel.pipeline/data/fsdp/context/tensor to -1 to "  # noqa: E501
            f"infer it{emulate}"
        )
    return tuple(sizes)


def mesh_devices(p, devices=None) -> list:
    """The devices a run uses: `parallel.num_devices` of them (0: all)."""
    devices = list(jax.devices() if devices is None else devices)
    if p.num_devices:
        if p.num_devices > len(devices):
            raise ConfigError(
                f"config field `parallel.num_devices`: {p.num_devices} requested, {len(devices)} available"
            )
        devices = devices[: p.num_devices]
    return devices


def make_mesh(p, devices=None) -> Mesh:
    """The mesh of a `parallel` config section on `devices` (default: all). Whether the model fits
    it is checked by boost_jax/validate.py `check_mesh` (the runtime's builder calls both)."""
    devices = mesh_devices(p, devices)
    shape = mesh_shape(p, len(devices), devices[0].platform if devices else "")
    # Auto axes: GSPMD propagates shardings from our parameter specs and activation constraints.
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def split_by_tensor(rules) -> set[str]:
    """The logical axes a rule table splits over the tensor axis (their first rule naming it)."""
    return {name for name, axes in rules if "tensor" in as_tuple(axes)}


def check_tensor_split(rules, tp: int, units: dict[str, tuple[str, int]]) -> None:
    """Every logical axis the table splits over `tensor` must hold a multiple of `tp` whole units.
    units: {logical axis: (config field, units)}, e.g. {"heads": ("model.n_heads", 32)}."""
    if tp == 1:
        return
    split = split_by_tensor(rules)
    for name, (field, value) in units.items():  # in the caller's order: the first misfit is named
        if name not in split:
            continue
        if value % tp:
            valid = [k for k in range(1, value + 1) if value % k == 0 and k <= 64]
            pad = (
                (f" (an imported model: --import-hf again with --intermediate-multiple {tp} zero-pads it, inertly)")
                if field == "model.d_ff"
                else ""
            )
            raise ConfigError(
                f"config field `parallel.tensor`: {tp} does not divide {field}={value}; "
                f"valid tensor sizes: {valid}{pad}"
            )


def check_grid(sizes: dict[str, int], widths: dict[str, int]) -> None:
    """Spatial-temporal GEMMs run on the square (fsdp, tensor) grid, whose columns split every
    projection width (its rows split the batch, checked with the batch)."""
    n = sizes["tensor"]
    if sizes["fsdp"] != n or n < 2:
        raise ConfigError(
            f"config field `parallel.linear_partition`: spatial-temporal GEMMs need a square "
            f"grid, parallel.fsdp == parallel.tensor >= 2 (got fsdp={sizes['fsdp']}, tensor={n})"
        )
    for field, value in widths.items():
        if value % n:
            raise ConfigError(f"config field `parallel.linear_partition`: the {n}x{n} grid must divide {field}={value}")


def check_batch(cfg, sizes: dict[str, int]) -> None:
    """The batch axes must split the micro-batch; the pipeline its layers and micro-batches."""
    m, t = cfg.model, cfg.train
    batch_ways = sizes["data"] * sizes["fsdp"]
    micro = t.global_batch // t.grad_accum
    if micro % batch_ways:
        raise ConfigError(
            f"config field `train.global_batch`: the micro-batch {micro} (= global_batch/grad_accum) "
            f"must be divisible by data*fsdp = {batch_ways}"
        )
    stages = sizes["pipeline"]
    if stages > 1:
        if m.n_layers % stages:
            raise ConfigError(
                f"config field `parallel.pipeline`: {stages} stages do not divide model.n_layers={m.n_layers}"
            )
        chunks = int(cfg.parallel.microbatches) or 2 * stages
        schedule = cfg.parallel.pipeline_schedule
        if schedule == "1f1b":
            if sizes.get("context", 1) > 1 or cfg.parallel.linear_partition.strip():
                raise ConfigError(
                    "config field `parallel.pipeline_schedule`: 1f1b does not run with context "
                    "parallelism or spatial-temporal projections; use gpipe or circular there"
                )
            repeats = int(cfg.parallel.pipeline_repeats)
            if m.n_layers % (stages * repeats):
                raise ConfigError(
                    f"config field `parallel.pipeline_repeats`: {repeats} chunks per stage on {stages} "
                    f"stages do not divide model.n_layers={m.n_layers} (V must divide n_layers/pipeline "
                    f"= {m.n_layers // stages})"
                )
            if repeats > 1 and chunks % stages:
                raise ConfigError(
                    f"config field `parallel.microbatches`: interleaved 1f1b (pipeline_repeats="
                    f"{repeats}) runs the micro-batches in groups of pipeline={stages}; {chunks} is not "
                    f"a multiple of {stages}"
                )
        if schedule == "circular":
            repeats = int(cfg.parallel.pipeline_repeats)
            if m.n_layers % (stages * repeats):
                raise ConfigError(
                    f"config field `parallel.pipeline_repeats`: {repeats} chunks per stage on {stages} "
                    f"stages do not divide model.n_layers={m.n_layers} (V must divide n_layers/pipeline "
                    f"= {m.n_layers // stages})"
                )
            if chunks < stages:
                raise ConfigError(
                    f"config field `parallel.microbatches`: the circular schedule needs at least one "
                    f"micro-batch per stage ({chunks} < pipeline={stages}): the first micro-batch's "
                    f"second round would reach stage 0 before it is free"
                )
        if micro % (chunks * batch_ways):
            raise ConfigError(
                f"config field `parallel.microbatches`: the micro-batch {micro} must split into "
                f"{chunks} pipeline micro-batches of a multiple of data*fsdp = {batch_ways} rows"
            )


def check_context(cfg, sizes: dict[str, int]) -> None:
    """`parallel.context` = C > 1: every row splits into 2C equal chunks (each device holds chunks i
    and 2C-1-i), and the projection groups keep their own layouts (the spatial-temporal grid splits
    the rows itself)."""
    c = sizes.get("context", 1)
    if c == 1:
        return
    seq = int(cfg.train.seq_len)
    if seq % (2 * c):
        raise ConfigError(
            f"config field `parallel.context`: {c} devices hold 2 of {2 * c} equal chunks of each row, "
            f"which train.seq_len={seq} does not split into; make seq_len a multiple of {2 * c}"
        )
    if cfg.parallel.linear_partition.strip():
        raise ConfigError(
            "config field `parallel.linear_partition`: spatial-temporal projections do not run under "
            f"parallel.context={c}; set linear_partition='' (or parallel.context=1)"
        )
