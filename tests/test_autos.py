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


@pytest.mark.parametrize("sizes", [{"tensor": 4}, {"data": 2, "tensor": 4}])
def test_a_tensor_parallel_stack_unrolls_only_under_remat_none(sizes):
    """On a mesh that only data and tensor split, `remat.policy=none` unrolls the stack (the scan keeps
    the same activations plus its stacked copies); a remat policy keeps the scan that recomputes, as
    `auto` does (lowrank); fsdp, pipeline or context splits keep the scan; CPUs keep it too."""

    def given(policy, gpu=True, **more):
        return autos.pick(
            group="auto",
            unroll="auto",
            policy=policy,
            norm="auto",
            linear="cola",
            gpu=gpu,
            sizes={**sizes, **more},
            triton=True,
        )

    assert given("none")["scan_unroll"] and given("none")["remat"] == "none"
    for policy in ("auto", "lowrank", "full"):
        assert not given(policy)["scan_unroll"]
    assert given("auto")["remat"] == "lowrank"
    for more in ({"fsdp": 2}, {"pipeline": 2}, {"context": 2}):
        assert not given("none", **more)["scan_unroll"]
    assert not given("none", gpu=False)["scan_unroll"]


def test_the_gate_product_inside_the_down_gemm_where_gate_and_up_are_apart():
    """model.gate_kernel=auto: gemm (kernels/gated_gemm.py) on GPUs for factored kinds whose B's are not
    grouped, pallas for a kind with an extra term from the input (sltrain), XLA's product where gate and
    up are one GEMM (dense, a tensor split) and on CPUs."""
    assert pick()["gate_kernel"] == pick(fsdp=8)["gate_kernel"] == pick(linear="lowrank")["gate_kernel"] == "gemm"
    assert pick(linear="sltrain")["gate_kernel"] == "pallas"
    assert (
        pick(linear="dense")["gate_kernel"] == pick(tensor=2)["gate_kernel"] == pick(gpu=False)["gate_kernel"] == "xla"
    )
