"""kernels/norm_choice.py `choose_norm`: every branch is reachable, the reason names the fact that decided
it, and a placement on a real mesh asks it with the mesh's and strategy's facts."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from boost_jax.config import base_config
from boost_jax.kernels.norm_choice import choose_norm
from boost_jax.parallel.placement import GROUPED, LOCAL, OnlineNorm, PerShardNorm, Placement, SpatialTemporal
from boost_jax.parallel.strategies import get_strategy

TENSOR_MESH = dict(mesh=True, tensor=2, online_norm=True, factored=True)


@pytest.mark.parametrize(
    "given, facts, kernel, fact",
    [
        ("auto", dict(gpu=False), "xla", "off a GPU"),
        ("auto", dict(gpu=True, triton=True), "triton", "with jax-triton"),
        ("auto", dict(gpu=True, triton=False), "pallas", "without jax-triton"),
        ("pallas", dict(gpu=False), "pallas", "kernels.rmsnorm=pallas"),
    ],
)
def test_the_kernel_follows_the_field_then_the_platform(given, facts, kernel, fact):
    choice = choose_norm(given, "separate", **facts)
    assert choice.kernel == kernel and fact in choice.reason, choice
    assert not (choice.per_shard or choice.online or choice.fused_add) and choice.name == kernel


def test_a_kernel_call_on_a_mesh_runs_per_shard_and_xla_does_not():
    shard = choose_norm("pallas", "separate", mesh=True)
    assert shard.per_shard and "on a mesh runs per shard" in shard.reason and shard.name == "per-shard pallas"
    assert not choose_norm("xla", "separate", mesh=True).per_shard
    assert not choose_norm("pallas", "separate").per_shard  # one device: nothing to split


def test_online_norm_needs_a_tensor_split_a_factored_kind_and_the_strategy():
    on = choose_norm("xla", "separate", **TENSOR_MESH)
    assert on.online and "online norm with tensor 2 and a factored kind" in on.reason
    assert on.name == "online rmsnorm, final norm xla"
    for off in (dict(tensor=1), dict(online_norm=False), dict(factored=False), dict(mesh=False)):
        assert not choose_norm("xla", "separate", **{**TENSOR_MESH, **off}).online, off


@pytest.mark.parametrize(
    "residual, kernel, facts, fused, fact",
    [
        ("auto", "triton", {}, True, "kernels.residual_norm=auto with triton"),
        ("fused", "xla", {}, True, "kernels.residual_norm=fused"),
        ("auto", "pallas", {}, False, "kernels.residual_norm=auto with pallas"),
        ("separate", "triton", {}, False, "kernels.residual_norm=separate"),
        ("auto", "triton", dict(mesh=True, pipeline=True), False, "a pipeline runs the stack"),
        ("auto", "triton", TENSOR_MESH, False, "the qkv/mlp_in norm rides in the A all-reduce"),
        ("auto", "triton", {**TENSOR_MESH, "st_groups": ("qkv",)}, False, "the mlp_in norm rides"),
        ("auto", "triton", {**TENSOR_MESH, "st_groups": ("qkv", "mlp_in")}, True, "with triton"),
        ("auto", "triton", {**TENSOR_MESH, "factored": False}, True, "with triton"),
    ],
)
def test_the_residual_add_fuses_unless_a_fact_needs_separate_adds(residual, kernel, facts, fused, fact):
    choice = choose_norm(kernel, residual, **facts)
    assert choice.fused_add == fused and fact in choice.reason, choice
    assert choice.name.startswith("fused") == fused


def _placement(**parallel):
    p = base_config().parallel
    p.update(parallel)
    shape = {a: int(p[a]) for a in ("pipeline", "data", "fsdp", "tensor")}
    devices = np.array(jax.devices()[: int(np.prod(list(shape.values())))]).reshape(tuple(shape.values()))
    return Placement(Mesh(devices, tuple(shape)), get_strategy(p))


def test_a_placement_asks_with_its_mesh_and_strategy():
    """BTP on tensor 2: online groups, per-shard kernels, separate adds; LOCAL: none of them."""
    btp = _placement(tensor=2, strategy="btp")
    choice = btp.norm_choice("triton", "auto", factored=True)
    assert choice.online and choice.per_shard and not choice.fused_add, choice
    assert isinstance(btp.norm(choice), PerShardNorm) and isinstance(btp.group("qkv", True), OnlineNorm)
    assert btp.group("qkv", False) is GROUPED  # an unfactored kind has no A all-reduce to ride in
    local = LOCAL.norm_choice("triton", "auto", factored=True)
    assert local.fused_add and not local.per_shard and LOCAL.group("qkv", True) is GROUPED
    piped = _placement(pipeline=2, strategy="btp").norm_choice("triton", "auto", factored=True)
    assert not piped.fused_add and "pipeline" in piped.reason
    st = _placement(fsdp=2, tensor=2, strategy="btp", linear_partition="qkv=st")
    assert isinstance(st.group("qkv", True), SpatialTemporal)
