"""hlo_comm: collectives read back from real compiled programs on 8 emulated CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.tools.hlo_comm import (
    Collective,
    compiled_collectives,
    parse_collectives,
    parse_replica_groups,
    summarize,
)

D, T = 2, 4  # mesh ("data", "tensor")
ROWS, COLS = 16, 32


def make_mesh(devices=None, shape=(D, T), names=("data", "tensor")):
    devices = np.asarray(jax.devices() if devices is None else devices).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "conftest must emulate 8 CPU devices"
    return make_mesh()


def smap(mesh, f, in_specs, out_specs):
    # check_vma=False: outputs of psum_scatter/ppermute are declared replicated for brevity.
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def collectives(mesh, f, *args):
    return parse_collectives(f.lower(*args).compile().as_text(), mesh)


def x(shape=(ROWS, COLS), dtype=jnp.float32):
    return jnp.ones(shape, dtype)


# ---------------------------------------------------------------- shard_map programs


def test_psum_over_tensor(mesh):
    (c,) = collectives(mesh, smap(mesh, lambda a: jax.lax.psum(a, "tensor"), P(), P()), x())
    assert c == Collective("all-reduce", ROWS * COLS, "f32", T, ("tensor",), c.computation, False, op_name=c.op_name)
    assert c.elements == 512 and c.computation.startswith("main")


def test_psum_over_data(mesh):
    (c,) = collectives(mesh, smap(mesh, lambda a: jax.lax.psum(a, "data"), P(), P()), x())
    assert (c.kind, c.elements, c.group_size, c.axes) == ("all-reduce", ROWS * COLS, D, ("data",))


def test_psum_over_both_axes(mesh):
    (c,) = collectives(mesh, smap(mesh, lambda a: jax.lax.psum(a, ("data", "tensor")), P(), P()), x())
    assert (c.group_size, c.axes) == (D * T, ("data", "tensor"))


def test_all_gather_counts_gathered_size(mesh):
    f = smap(mesh, lambda a: jax.lax.all_gather(a, "tensor", tiled=True), P("tensor"), P())
    (c,) = collectives(mesh, f, x())  # each device holds [ROWS/T, COLS] and receives [ROWS, COLS]
    assert (c.kind, c.elements, c.group_size, c.axes) == ("all-gather", ROWS * COLS, T, ("tensor",))


def test_reduce_scatter_counts_input_size(mesh):
    f = smap(mesh, lambda a: jax.lax.psum_scatter(a, "tensor", tiled=True), P(), P("tensor"))
    (c,) = collectives(mesh, f, x())  # input [ROWS, COLS] per device, output [ROWS/T, COLS]
    assert (c.kind, c.elements, c.group_size, c.axes) == ("reduce-scatter", ROWS * COLS, T, ("tensor",))


def test_all_to_all(mesh):
    f = smap(mesh, lambda a: jax.lax.all_to_all(a, "tensor", 0, 1, tiled=True), P(), P())
    (c,) = collectives(mesh, f, x())  # CPU splits it into a tuple of T chunks: summed back
    assert (c.kind, c.elements, c.group_size, c.axes) == ("all-to-all", ROWS * COLS, T, ("tensor",))


def test_ppermute_ring_and_swap(mesh):
    ring = [(i, (i + 1) % T) for i in range(T)]
    (c,) = collectives(mesh, smap(mesh, lambda a: jax.lax.ppermute(a, "tensor", ring), P(), P()), x())
    assert (c.kind, c.elements, c.group_size, c.axes) == ("collective-permute", ROWS * COLS, T, ("tensor",))
    (c,) = collectives(mesh, smap(mesh, lambda a: jax.lax.ppermute(a, "data", [(0, 1), (1, 0)]), P(), P()), x((8,)))
    assert (c.elements, c.group_size, c.axes) == (8, D, ("data",))


def test_tuple_psum_sums_members(mesh):
    # XLA may emit one tuple all-reduce (and carries the bf16 member as f32): count elements only.
    f = smap(mesh, lambda a, b: jax.lax.psum((a, b), "tensor"), (P(), P()), (P(), P()))
    cs = collectives(mesh, f, x(), x((8,), jnp.bfloat16))
    assert {c.kind for c in cs} == {"all-reduce"} and {c.axes for c in cs} == {("tensor",)}
    assert sum(c.elements for c in cs) == ROWS * COLS + 8


def test_psum_in_fori_loop_and_nested_cond(mesh):
    def body(i, carry):
        carry = jax.lax.psum(carry, "tensor") * 0.5
        return jax.lax.cond(i > 0, lambda c: jax.lax.psum(c, "data"), lambda c: c, carry)

    f = smap(mesh, lambda a: jax.lax.psum(jax.lax.fori_loop(0, 3, body, a), "tensor"), P(), P())
    cs = collectives(mesh, f, x())
    looped = sorted((c.axes, c.elements) for c in cs if c.in_loop)
    assert looped == [(("data",), ROWS * COLS), (("tensor",), ROWS * COLS)]
    (outside,) = [c for c in cs if not c.in_loop]
    assert outside.axes == ("tensor",) and outside.computation.startswith("main")
    assert all(not c.computation.startswith("main") for c in cs if c.in_loop)


def test_trips_multiply_nested_loop_trip_counts(mesh):
    def inner(c, _):
        return jax.lax.psum(c, "tensor") * 0.5, None

    def outer(c, _):
        c = jax.lax.scan(inner, c, None, length=3)[0]
        return jax.lax.psum(c, "data") * 0.5, None

    f = smap(mesh, lambda a: jax.lax.psum(jax.lax.scan(outer, a, None, length=5)[0], "tensor"), P(), P())
    trips = sorted((c.axes, c.in_loop, c.trips) for c in collectives(mesh, f, x()))
    assert trips == [(("data",), True, 5), (("tensor",), False, 1), (("tensor",), True, 15)]


def test_ids_are_mesh_positions_not_device_ids():
    # A permuted mesh compiles to the same replica_groups; only positions give the right axes.
    devices = np.asarray(jax.devices())[[0, 2, 4, 6, 1, 3, 5, 7]]
    mesh = make_mesh(devices)
    (c,) = collectives(mesh, smap(mesh, lambda a: jax.lax.psum(a, "tensor"), P(), P()), x())
    assert c.axes == ("tensor",) and c.group_size == T


# ---------------------------------------------------------------- GSPMD (mesh-axes replica groups)


def test_gspmd_matmul_contracting_dim_all_reduce(mesh):
    def f(a, w):
        a = jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(None, "tensor")))
        w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P("tensor", None)))
        return jax.lax.with_sharding_constraint(a @ w, NamedSharding(mesh, P()))

    cs = compiled_collectives(f, x(), x((COLS, 64)), mesh=mesh)
    assert [(c.kind, c.elements, c.group_size, c.axes) for c in cs] == [("all-reduce", ROWS * 64, T, ("tensor",))]


@pytest.mark.parametrize("rows", [("a", "c"), ("c", "a")])
def test_gspmd_sum_over_two_of_three_axes(rows):
    mesh3 = make_mesh(shape=(2, 2, 2), names=("a", "b", "c"))

    def f(a):
        a = jax.lax.with_sharding_constraint(a, NamedSharding(mesh3, P(rows, "b")))
        return jax.lax.with_sharding_constraint(a.sum(0), NamedSharding(mesh3, P("b")))

    (c,) = compiled_collectives(f, x(), mesh=mesh3)  # per device: [ROWS/4, COLS/2] summed to [COLS/2]
    assert (c.kind, c.elements, c.group_size, c.axes) == ("all-reduce", COLS // 2, 4, ("a", "c"))


def test_summarize(mesh):
    def f(a):
        return jax.lax.psum(a, "tensor") + jax.lax.psum(a[:4], "data")[0] + jax.lax.all_gather(a, "data").sum(0)

    cs = collectives(mesh, smap(mesh, f, P(), P()), x())
    n = ROWS * COLS
    assert summarize(cs, by=("axes",)) == {
        ("tensor",): {"count": 1, "elements": n},
        ("data",): {"count": 2, "elements": 4 * COLS + D * n},
    }
    assert summarize(cs) == {
        "all-reduce": {"count": 2, "elements": n + 4 * COLS},
        "all-gather": {"count": 1, "elements": D * n},
    }
    assert summarize(cs, by=("kind", "axes"))[("all-gather", ("data",))] == {"count": 1, "elements": D * n}


# ---------------------------------------------------------------- literal syntax


def test_replica_group_syntaxes():
    assert parse_replica_groups("{{0,1,2,3},{4,5,6,7}}") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_replica_groups("{}", 4) == [[0, 1, 2, 3]]
    assert parse_replica_groups("[2,4]<=[8]") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_replica_groups("[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert parse_replica_groups("[2,4]<=[2,2,2]T(1,0,2)") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # Mesh-axes form printed by GSPMD/Shardy partitioning (seen with jax 0.10).
    assert parse_replica_groups("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_replica_groups("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    permuted = "mesh['axis_0'=4,'axis_1'=2], device_ids=([2,2,2]T(0,2,1))"  # devices [[0,2],[1,3],[4,6],[5,7]]
    assert parse_replica_groups(permuted + " {'axis_0'}") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert parse_replica_groups(permuted + " {'axis_0':(2)2}") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert parse_replica_groups(permuted + " {'axis_0':(1)2}") == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert parse_replica_groups("mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_2','axis_0'}") == [
        [0, 4, 1, 5],
        [2, 6, 3, 7],
    ]


ASYNC_HLO = """HloModule jit_step, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

%async_computation (p0: bf16[8,64]) -> bf16[8,64] {
  %p0 = bf16[8,64]{1,0} parameter(0)
  ROOT %all-to-all.1 = bf16[8,64]{1,0} all-to-all(%p0), channel_id=4, replica_groups=[2,4]<=[8], dimensions={0}
}

%body (param: (s32[], f32[16,32])) -> (s32[], f32[16,32]) {
  %param = (s32[], f32[16,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %gte = f32[16,32]{1,0} get-tuple-element(%param), index=1
  %all-reduce-start = f32[16,32]{1,0} all-reduce-start(%gte), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %all-reduce-done = f32[16,32]{1,0} all-reduce-done(%all-reduce-start)
  ROOT %t = (s32[], f32[16,32]{1,0}) tuple(%i, %all-reduce-done)
}

%cond (param.1: (s32[], f32[16,32])) -> pred[] {
  %param.1 = (s32[], f32[16,32]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: f32[4,32], b: bf16[8,64], c: f32[16,32], s: s32[]) -> f32[16,32] {
  %a = f32[4,32]{1,0} parameter(0)
  %b = bf16[8,64]{1,0} parameter(1)
  %c = f32[16,32]{1,0} parameter(2)
  %s = s32[] parameter(3)
  %ag-start = (f32[4,32]{1,0}, f32[16,32]{1,0}) all-gather-start(f32[4,32]{1,0} %a), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %ag-done = f32[16,32]{1,0} all-gather-done(%ag-start)
  %cp-start = (f32[16,32]{1,0}, f32[16,32]{1,0}, u32[], u32[]) collective-permute-start(%c), channel_id=3, source_target_pairs={{0,4},{4,0},{1,5},{5,1}}
  %cp-done = f32[16,32]{1,0} collective-permute-done(%cp-start)
  %a2a-start = ((bf16[8,64]{1,0}), bf16[8,64]{1,0}) async-start(%b), calls=%async_computation
  %a2a-done = bf16[8,64]{1,0} async-done(%a2a-start)
  %rs = f32[4,32]{1,0} reduce-scatter(%c), channel_id=5, replica_groups={}, use_global_device_ids=true, dimensions={0}, to_apply=%add
  %init = (s32[], f32[16,32]{1,0}) tuple(%s, %ag-done)
  %while = (s32[], f32[16,32]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[16,32]{1,0} get-tuple-element(%while), index=1
}
"""


def test_async_forms_and_loops_from_literal_hlo():
    cs = parse_collectives(ASYNC_HLO, make_mesh())
    got = [(c.kind, c.elements, c.dtype, c.group_size, c.axes, c.computation, c.in_loop) for c in cs]
    assert got == [
        ("all-to-all", 8 * 64, "bf16", 4, ("tensor",), "async_computation", False),
        ("all-reduce", 16 * 32, "f32", 2, ("data",), "body", True),
        ("all-gather", 4 * 32 * 4, "f32", 4, ("tensor",), "main", False),
        ("collective-permute", 16 * 32, "f32", 2, ("data",), "main", False),
        ("reduce-scatter", 16 * 32, "f32", 8, ("data", "tensor"), "main", False),
    ]
    # Without a mesh the axes are unknown but everything else is still counted.
    assert [c.axes for c in parse_collectives(ASYNC_HLO)] == [()] * 5
