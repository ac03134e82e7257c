"""`auto` rules (boost_jax/model/autos.py) as plain functions of the platform and the mesh."""

import pytest

from boost_jax.model import autos


def pick(gpu=True, triton=True, linear="cola", **sizes):
    return autos.pick(
        group="auto", unroll="auto", policy="auto", norm="auto", linear=linear, gpu=gpu, sizes=sizes, triton=triton
    )


@pytest.mark.parametrize(
    "sizes", [{}, {"fsdp": 8}, {"tensor": 4}, {"data": 2}, {"pipeline": 2}, {"data": 2, "fsdp": 4}]
)
def test_the_fused_norm_on_every_gpu_mesh(sizes):
    """The fused norm wherever the model runs on GPUs, vmapped or not (the pipeline's stages and the
    data-parallel gradient island batch the kernels through kernels/row_batching.py); XLA's on CPUs."""
    assert pick(**sizes)["rmsnorm"] == "triton"
    assert pick(triton=False, **sizes)["rmsnorm"] == "pallas"
    assert pick(gpu=False, **sizes)["rmsnorm"] == "xla"


def test_unroll_group_and_remat_follow_the_mesh():
    one = pick()
    assert one["scan_unroll"] and one["group_linears"] == "first" and one["remat"] == "none"
    assert pick(gpu=False)["group_linears"] is False
    sharded = pick(fsdp=8)
    assert not sharded["scan_unroll"] and sharded["remat"] == "lowrank"
    assert pick(tensor=2)["group_linears"] and pick(linear="dense")["group_linears"]
    assert pick(fsdp=8, linear="dense")["remat"] == "full"
