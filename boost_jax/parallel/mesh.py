"""The device mesh: named axes (data, fsdp, tensor) sized from `parallel.*`, one of them inferable."""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from boost_jax.config import ConfigError
from boost_jax.model.kinds import kind_class

AXES = ("pipeline", "data", "fsdp", "tensor")  # outermost first: pipeline stages may span nodes
BATCH_AXES = ("data", "fsdp")  # the global batch is split over both
# `parallel` settings that put a run (any mesh, any partition) on a single device.
ONE_DEVICE = dict(pipeline=1, data=1, fsdp=1, tensor=1, num_devices=0, linear_partition="")


def mesh_shape(p, n_devices: int) -> tuple[int, ...]:
    sizes = [int(p[a]) for a in AXES]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise ConfigError(f"config field `parallel`: {dict(zip(AXES, sizes))} cannot be completed to "
                              f"{n_devices} devices ({known} does not divide {n_devices})")
        sizes[sizes.index(-1)] = n_devices // known
    if math.prod(sizes) != n_devices:
        raise ConfigError(f"config field `parallel`: pipeline*data*fsdp*tensor = {math.prod(sizes)} but there are "
                          f"{n_devices} devices; set one of parallel.data/fsdp/tensor to -1 to infer it")
    return tuple(sizes)


def check_divisibility(cfg, shape: tuple[int, ...]) -> None:
    """The tensor axis must split whole heads, KV heads and the MLP and hidden widths (and the rank
    for strategies that split it); the batch axes must split the micro-batch."""
    m, t = cfg.model, cfg.train
    sizes = dict(zip(AXES, shape))
    tp = sizes["tensor"]
    if tp > 1:
        need = {"model.n_heads": m.n_heads, "model.n_kv_heads": m.n_kv_heads, "model.d_ff": m.d_ff,
                "model.d_model": m.d_model}
        if kind_class(m.linear).factored and cfg.parallel.strategy == "vanilla":
            need["model.rank"] = m.rank
        for field, value in need.items():
            if value % tp:
                valid = [k for k in range(1, value + 1) if value % k == 0 and k <= 64]
                pad = (" (an imported model: --import-hf again with --intermediate-multiple "
                       f"{tp} zero-pads it, inertly)") if field == "model.d_ff" else ""
                raise ConfigError(f"config field `parallel.tensor`: {tp} does not divide {field}={value}; "
                                  f"valid tensor sizes: {valid}{pad}")
    if cfg.parallel.linear_partition.strip():
        from boost_jax.parallel.strategies import st_groups
        if st_groups(cfg.parallel.linear_partition):
            n = sizes["tensor"]
            if sizes["fsdp"] != n or n < 2:
                raise ConfigError(f"config field `parallel.linear_partition`: spatial-temporal GEMMs need a square "
                                  f"grid, parallel.fsdp == parallel.tensor >= 2 (got fsdp={sizes['fsdp']}, tensor={n})")
            # The grid's rows split the batch (already checked against data*fsdp below), its
            # columns every projection width.
            widths = {"model.d_model": m.d_model, "model.d_ff": m.d_ff,
                      "model.n_kv_heads*head_dim": m.n_kv_heads * (m.d_model // m.n_heads)}
            if kind_class(m.linear).factored:
                widths["model.rank"] = m.rank
            for field, value in widths.items():
                if value % n:
                    raise ConfigError(f"config field `parallel.linear_partition`: the {n}x{n} grid must divide "
                                      f"{field}={value}")
    batch_ways = sizes["data"] * sizes["fsdp"]
    micro = t.global_batch // t.grad_accum
    if micro % batch_ways:
        raise ConfigError(f"config field `train.global_batch`: the micro-batch {micro} (= global_batch/grad_accum) "
                          f"must be divisible by data*fsdp = {batch_ways}")
    stages = sizes["pipeline"]
    if stages > 1:
        if m.n_layers % stages:
            raise ConfigError(f"config field `parallel.pipeline`: {stages} stages do not divide "
                              f"model.n_layers={m.n_layers}")
        chunks = int(cfg.parallel.microbatches) or 2 * stages
        if micro % (chunks * batch_ways):
            raise ConfigError(f"config field `parallel.microbatches`: the micro-batch {micro} must split into "
                              f"{chunks} pipeline micro-batches of a multiple of data*fsdp = {batch_ways} rows")


def make_mesh(cfg, devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    if cfg.parallel.num_devices:
        if cfg.parallel.num_devices > len(devices):
            raise ConfigError(f"config field `parallel.num_devices`: {cfg.parallel.num_devices} requested, "
                              f"{len(devices)} available")
        devices = devices[: cfg.parallel.num_devices]
    shape = mesh_shape(cfg.parallel, len(devices))
    check_divisibility(cfg, shape)
    # Auto axes: GSPMD propagates shardings from our parameter specs and activation constraints.
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))
