"""A cluster description (configs/clusters/*.py) as a frozen dataclass the cost model reads."""

from __future__ import annotations

import dataclasses
import math

from boost_jax.config import load_config_file


@dataclasses.dataclass(frozen=True)
class Link:
    bandwidth: float  # effective bytes/s per GPU in a ring collective (NCCL "bus bandwidth")
    latency: float  # seconds per ring step (α)


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    peak_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    usable_hbm_fraction: float
    intra: Link
    inter: Link
    gemm_efficiency: float
    gemm_half_dim: float
    flash_efficiency: float
    elementwise_passes: float
    # HBM passes per byte of activation a layer keeps for its backward (the scanned layer stack writes
    # each kept array into its stacked residual and the backward reads it back, through copies XLA adds
    # around the loop); 0: not priced (cost.price, `kept`)
    kept_passes: float = 0.0
    # (field, the data it was fitted to) for every number chosen to reproduce a measurement; the
    # other fields are datasheet values or stated assumptions (the cluster file says which).
    fitted: tuple = ()

    @property
    def usable_hbm(self) -> float:
        return self.hbm_bytes * self.usable_hbm_fraction

    def link(self, stride: int, size: int) -> Link:
        """The link a group of `size` devices `stride` ids apart runs on. Mesh axes are laid out
        row-major over consecutive device ids, so a group stays inside one node iff it covers
        at most gpus_per_node consecutive ids."""
        return self.intra if stride * size <= self.gpus_per_node else self.inter

    def spans_nodes(self, stride: int, size: int) -> bool:
        return stride * size > self.gpus_per_node


_FIELDS = (
    "name",
    "gpus_per_node",
    "peak_flops",
    "hbm_bytes",
    "hbm_bandwidth",
    "usable_hbm_fraction",
    "intra_bandwidth",
    "intra_latency",
    "inter_bandwidth",
    "inter_latency",
    "gemm_efficiency",
    "gemm_half_dim",
    "flash_efficiency",
    "elementwise_passes",
)


FRACTIONS = ("usable_hbm_fraction", "gemm_efficiency", "flash_efficiency")  # shares of a whole: at most 1
OPTIONAL = {"kept_passes": 0.0}  # fields a cluster file may leave out, with the value they then take


def from_dict(c) -> Cluster:
    missing = [f for f in _FIELDS if f not in c]
    if missing:
        raise ValueError(f"--cluster: the cluster config lacks {missing} (see configs/clusters/a100_4x.py)")
    for f in _FIELDS[1:]:
        try:
            value = float(c[f])
        except (TypeError, ValueError):
            raise ValueError(f"--cluster: {f} must be a number, got {c[f]!r}") from None
        if not (value > 0 and math.isfinite(value)) or isinstance(c[f], bool):
            raise ValueError(f"--cluster: {f} must be a positive number, got {c[f]!r}")
        if f in FRACTIONS and value > 1:
            raise ValueError(f"--cluster: {f} is a fraction, at most 1, got {c[f]!r}")
    if int(float(c["gpus_per_node"])) != float(c["gpus_per_node"]):
        raise ValueError(f"--cluster: gpus_per_node must be a whole number, got {c['gpus_per_node']!r}")
    optional = {}
    for f, default in OPTIONAL.items():
        value = c[f] if f in c else default
        try:
            optional[f] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"--cluster: {f} must be a number, got {value!r}") from None
        if not (optional[f] >= 0 and math.isfinite(optional[f])) or isinstance(value, bool):
            raise ValueError(f"--cluster: {f} must be a number >= 0, got {value!r}")
    fitted = dict(c["fitted"].items()) if "fitted" in c and c["fitted"] else {}
    unknown = [f for f in fitted if f not in _FIELDS[1:] + tuple(OPTIONAL)]
    if unknown:
        raise ValueError(
            f"--cluster: `fitted` names {unknown}, which are not cluster fields; use some of "
            f"{list(_FIELDS[1:] + tuple(OPTIONAL))}"
        )
    return Cluster(
        name=str(c["name"]),
        gpus_per_node=int(c["gpus_per_node"]),
        peak_flops=float(c["peak_flops"]),
        hbm_bytes=float(c["hbm_bytes"]),
        hbm_bandwidth=float(c["hbm_bandwidth"]),
        usable_hbm_fraction=float(c["usable_hbm_fraction"]),
        intra=Link(float(c["intra_bandwidth"]), float(c["intra_latency"])),
        inter=Link(float(c["inter_bandwidth"]), float(c["inter_latency"])),
        gemm_efficiency=float(c["gemm_efficiency"]),
        gemm_half_dim=float(c["gemm_half_dim"]),
        flash_efficiency=float(c["flash_efficiency"]),
        elementwise_passes=float(c["elementwise_passes"]),
        **optional,
        fitted=tuple((str(k), str(v)) for k, v in fitted.items()),
    )


def load_cluster(path) -> Cluster:
    """The Cluster of a configs/clusters/*.py file (its `get_config()`)."""
    try:
        fields = load_config_file(path, "--cluster")
    except FileNotFoundError as e:
        raise ValueError(f"{e} (e.g. configs/clusters/a100_4x.py)") from e
    try:
        return from_dict(fields)
    except ValueError as e:  # name the file
        raise ValueError(str(e).replace("--cluster:", f"--cluster {path}:", 1)) from None
