"""`auto` rules (boost_jax/model/autos.py) as plain functions of the platform and the mesh."""

import pytest

from boost_jax.model import autos


def pick(gpu=True, triton=True, linear="cola", **sizes):
    return autos.pick(
        group="auto", unroll="auto", policy="auto", norm="auto", linear=linear, gpu=gpu, sizes=sizes, triton=triton
    )


@pytest.mark.parametrize(
    "sizes,norm",
    [
        ({}, "triton"),
        ({"fsdp": 8}, "triton"),
        ({"tensor": 4}, "triton"),
        ({"data": 2}, "xla"),
        ({"pipeline": 2}, "xla"),
        ({"data": 2, "fsdp": 4}, "xla"),
    ],
)
def test_the_fused_norm_only_where_nothing_vmaps_the_model(sizes, norm):
    """jax-triton's kernels take no vmap: the pipeline's stages and the data-parallel gradient island
    (parallel/grad_reduce.py) vmap the model, so `auto` keeps XLA's norm there."""
    assert pick(**sizes)["rmsnorm"] == norm
    assert pick(triton=False, **sizes)["rmsnorm"] == ("pallas" if norm == "triton" else "xla")
    assert pick(gpu=False, **sizes)["rmsnorm"] == "xla"


def test_unroll_group_and_remat_follow_the_mesh():
    one = pick()
    assert one["scan_unroll"] and not one["group_linears"] and one["remat"] == "none"
    sharded = pick(fsdp=8)
    assert not sharded["scan_unroll"] and sharded["remat"] == "lowrank"
    assert pick(tensor=2)["group_linears"] and pick(linear="dense")["group_linears"]
    assert pick(fsdp=8, linear="dense")["remat"] == "full"
