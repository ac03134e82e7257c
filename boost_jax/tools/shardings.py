"""Print how a strategy lays out every parameter (from abstract shapes; nothing is allocated).

    python -m boost_jax.tools.shardings --config configs/cola_60m.py [--mesh 1,1,4] [--strategy btp]
        [--show layers/attn/q/a]

One line per parameter: path, global shape, per-device shape, logical axes, PartitionSpec.
`--show PATH` builds that one parameter (zeros, placed with its sharding) and draws which device
holds which block with `jax.debug.visualize_array_sharding`. That draws 1-D and 2-D arrays only;
stacked layer parameters are [layers, ...] with the layer axis never sharded, so layer 0's slice
(same layout as every layer) is drawn.
"""

from __future__ import annotations

import argparse
import difflib
import math
import sys

from boost_jax.errors import ConfigError
from boost_jax.tools.devices import emulate_cpu_devices, load_config, mesh_fields, parse_mesh, pick_devices
from boost_jax.validate import validate


def _path(keys) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)


def param_table(cfg, devices):
    """[(path, shape, local shape, axes, spec)], the mesh and the parameters' shardings by path."""
    return _param_table(cfg, devices)[:3]


def _param_table(cfg, devices):
    """param_table's three, and the parameters' dtypes by path."""
    import jax

    from boost_jax.runtime.build import build  # lazy: loads JAX; main emulates the devices first
    from boost_jax.runtime.state import is_axes  # lazy: loads JAX; main emulates the devices first

    built = build(cfg, devices)
    spec, mesh = built.spec, built.mesh
    axes = {_path(p): a for p, a in jax.tree_util.tree_flatten_with_path(spec.axes, is_leaf=is_axes)[0]}
    rows, shardings, dtypes = [], {}, {}
    for p, leaf in jax.tree_util.tree_flatten_with_path(spec.abstract["params"])[0]:
        path = _path(p)
        shardings[path] = leaf.sharding
        dtypes[path] = leaf.dtype
        rows.append(
            (path, tuple(leaf.shape), tuple(leaf.sharding.shard_shape(leaf.shape)), axes[path], leaf.sharding.spec)
        )
    return rows, mesh, shardings, dtypes


def format_table(rows) -> str:
    cells = [("path", "shape", "per device", "logical axes", "PartitionSpec")]
    cells += [
        (p, str(s), str(local), "(" + ", ".join(str(a) for a in ax) + ")", str(spec)) for p, s, local, ax, spec in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def count_line(rows, dtypes) -> str:
    """Totals: trained parameters (floating point) and fixed integer entries (a sparse support), whole
    and per device."""
    import numpy as np

    total = {True: [0, 0], False: [0, 0]}
    for path, shape, local, _, _ in rows:
        trained = bool(np.issubdtype(dtypes[path], np.inexact))
        total[trained][0] += math.prod(shape)
        total[trained][1] += math.prod(local)
    line = f"parameters: {total[True][0]:,} ({total[True][0] / 1e6:.1f}M), per device {total[True][1]:,}"
    if total[False][0]:
        line += f"; fixed integer entries (not trained): {total[False][0]:,}, per device {total[False][1]:,}"
    return line


def show(path: str, rows, shardings) -> None:
    """Place zeros of one parameter with its sharding and draw the device layout."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    path = path.replace(".", "/")
    if path not in shardings:
        close = difflib.get_close_matches(path, list(shardings), n=5, cutoff=0.3)
        raise SystemExit(f"--show: no parameter {path!r}; close matches: {close or sorted(shardings)[:8]}")
    _, shape, _, axes, spec = next(r for r in rows if r[0] == path)
    sharding = shardings[path]
    if len(shape) > 2:
        if axes[0] != "layers" or (len(spec) and spec[0] is not None):
            raise SystemExit(
                f"--show: {path} is {len(shape)}-D {shape} and not a stack of layers; "
                "visualize_array_sharding draws 1-D and 2-D arrays only"
            )
        print(
            f"{path} is a stack of {shape[0]} layers (layer axis not sharded); drawing layer 0's "
            f"{list(shape[1:])} slice, laid out as {P(*spec[1:])}:"
        )
        shape, sharding = shape[1:], NamedSharding(sharding.mesh, P(*spec[1:]))
    else:
        print(f"{path} {list(shape)} laid out as {spec}:")
    x = jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=sharding)()
    jax.debug.visualize_array_sharding(x)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a configs/*.py file, e.g. configs/cola_60m.py")
    ap.add_argument(
        "--mesh",
        default="1,1,4",
        help="data,fsdp,tensor (or pipeline,data,fsdp[,context],tensor) sizes (default 1,1,4)",
    )
    ap.add_argument(
        "--strategy",
        help="a registered strategy, e.g. btp | vanilla | megatron (default: the config's parallel.strategy)",
    )
    ap.add_argument("--show", metavar="PARAM_PATH", help="draw one parameter's layout, e.g. layers/attn/q/a")
    args = ap.parse_args(argv)
    mesh_sizes = parse_mesh(args.mesh)
    emulate_cpu_devices(math.prod(mesh_sizes))  # before anything imports jax
    from boost_jax.parallel.strategies import names  # lazy: loads JAX; the devices are emulated above

    cfg = load_config(args.config)
    if args.strategy:
        if args.strategy not in names():
            raise SystemExit(f"--strategy: {args.strategy!r} is not one of {names()}")
        cfg.parallel.strategy = args.strategy
    sizes = mesh_fields(mesh_sizes)
    data, fsdp = sizes["data"], sizes["fsdp"]
    cfg.parallel.update(sizes, num_devices=math.prod(mesh_sizes))
    cfg.train.global_batch = max(cfg.train.global_batch // (data * fsdp), 1) * data * fsdp  # divisible
    cfg.train.grad_accum = 1
    cfg.data.source = "embedded"  # nothing is read; a zoo config's `tokens` source would need a path
    try:
        validate(cfg)
        rows, mesh, shardings, dtypes = _param_table(cfg, pick_devices(math.prod(mesh_sizes)))
    except ConfigError as e:
        raise SystemExit(f"{e} (set via --mesh/--strategy)") from e
    print(f"{cfg.name}: strategy {cfg.parallel.strategy}, linear {cfg.model.linear}, mesh {dict(mesh.shape)}")
    print(format_table(rows))
    print(count_line(rows, dtypes))
    if args.show:
        print()
        show(args.show, rows, shardings)


if __name__ == "__main__":
    main(sys.argv[1:])
