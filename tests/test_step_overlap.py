"""tools/step_profile/overlap.py and the roofline of tools/step_profile/pricing.py: the compute scheduled between an
async collective's start and done hides it, each kernel's time once; a synchronous collective is
exposed; the roofline is each kernel at the GPU's peaks. Every expected number is computed here from
the shapes and the target's numbers, not read back from the code under test."""

import math

import numpy as np
import pytest

from boost_jax.tools import aot
from boost_jax.tools.step_profile import command as step_command
from boost_jax.tools.step_profile import kernels as step_kernels
from boost_jax.tools.step_profile import pricing as step_pricing

needs_aot = pytest.mark.skipif(not aot.available(), reason=f"needs the aot extra ({aot.missing()})")

# The entry of a scheduled 2-device module: all-reduce s1 in flight over GEMM g1 and elementwise e1;
# s2 and s3 both in flight over GEMM g2 (which can hide only one of them once); s4 with nothing
# between start and done; a synchronous all-reduce ar5; s6 in flight over a while loop of TRIPS
# trips whose body runs GEMM gb.
TRIPS, R, C, M, K, N = 16, 256, 1024, 512, 1024, 768
HLO = """HloModule jit_step, is_scheduled=true, num_partitions=2

%gemm_comp (a: bf16[M,K], b: bf16[K,N]) -> bf16[M,N] {
  %a = bf16[M,K]{1,0} parameter(0)
  %b = bf16[K,N]{1,0} parameter(1)
  ROOT %dot = bf16[M,N]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%neg_comp (p: f32[R,C]) -> f32[R,C] {
  %p = f32[R,C]{1,0} parameter(0)
  ROOT %n = f32[R,C]{1,0} negate(%p)
}

%add_comp (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (param: (s32[], bf16[M,K], bf16[K,N])) -> (s32[], bf16[M,K], bf16[K,N]) {
  %param = (s32[], bf16[M,K]{1,0}, bf16[K,N]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %a = bf16[M,K]{1,0} get-tuple-element(%param), index=1
  %b = bf16[K,N]{1,0} get-tuple-element(%param), index=2
  %gb = bf16[M,N]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_comp, GEMM_CFG
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[M,K]{1,0}, bf16[K,N]{1,0}) tuple(%next, %a, %b)
}

%cond (param: (s32[], bf16[M,K], bf16[K,N])) -> pred[] {
  %param = (s32[], bf16[M,K]{1,0}, bf16[K,N]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %n = s32[] constant(TRIPS)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[R,C], a: bf16[M,K], b: bf16[K,N]) -> f32[R,C] {
  %x = f32[R,C]{1,0} parameter(0)
  %a = bf16[M,K]{1,0} parameter(1)
  %b = bf16[K,N]{1,0} parameter(2)
  %s1 = f32[R,C]{1,0} all-reduce-start(%x), replica_groups={{0,1}}, to_apply=%add_comp
  %g1 = bf16[M,N]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_comp, GEMM_CFG
  %e1 = f32[R,C]{1,0} fusion(%x), kind=kLoop, calls=%neg_comp
  %d1 = f32[R,C]{1,0} all-reduce-done(%s1)
  %s2 = f32[R,C]{1,0} all-reduce-start(%d1), replica_groups={{0,1}}, to_apply=%add_comp
  %s3 = f32[R,C]{1,0} all-reduce-start(%e1), replica_groups={{0,1}}, to_apply=%add_comp
  %g2 = bf16[M,N]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_comp, GEMM_CFG
  %d2 = f32[R,C]{1,0} all-reduce-done(%s2)
  %d3 = f32[R,C]{1,0} all-reduce-done(%s3)
  %s4 = f32[R,C]{1,0} all-reduce-start(%d2), replica_groups={{0,1}}, to_apply=%add_comp
  %d4 = f32[R,C]{1,0} all-reduce-done(%s4)
  %ar5 = f32[R,C]{1,0} all-reduce(%d4), replica_groups={{0,1}}, to_apply=%add_comp
  %s6 = f32[R,C]{1,0} all-reduce-start(%ar5), replica_groups={{0,1}}, to_apply=%add_comp
  %zero = s32[] constant(0)
  %init = (s32[], bf16[M,K]{1,0}, bf16[K,N]{1,0}) tuple(%zero, %a, %b)
  %w = (s32[], bf16[M,K]{1,0}, bf16[K,N]{1,0}) while(%init), condition=%cond, body=%body, TRIP_CFG
  %d6 = f32[R,C]{1,0} all-reduce-done(%s6)
  ROOT %out = f32[R,C]{1,0} add(%d6, %d3)
}
"""
for key, value in {"TRIPS": TRIPS, "M": M, "K": K, "N": N, "R": R, "C": C}.items():
    HLO = HLO.replace(key + "]", f"{value}]").replace(key + ",", f"{value},").replace(f"({key})", f"({value})")
HLO = HLO.replace("GEMM_CFG", 'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}')
HLO = HLO.replace("TRIP_CFG", 'backend_config={"known_trip_count":{"n":"%d"}}' % TRIPS)


@pytest.fixture
def costs():
    rng = np.random.default_rng()
    return step_pricing.Costs({c: float(rng.uniform(0.3, 0.9)) for c in step_pricing.GEMM_CLASSES}, 0.4, 0.0)


def expected_times(t, c):
    """Seconds of one run of each kernel kind, from the shapes and the target's numbers."""
    gemm = max(
        2.0 * M * N * K / (t.bf16_flops * c.gemm_efficiency["medium"]), 2 * (M * K + K * N + M * N) / t.hbm_bytes_per_s
    )
    elementwise = 2 * R * C * 4 / t.hbm_bytes_per_s
    n = 2
    allreduce = 2 * (n - 1) / n * R * C * 4 / t.link_bytes_per_s + 2 * (n - 1) * t.link_latency_s
    return gemm, elementwise, allreduce


def test_windows_hold_the_compute_between_start_and_done():
    ks = {k.name: k for k in step_kernels.kernels(HLO)}
    assert ks["s1"].window == (("main", "g1", 1.0), ("main", "e1", 1.0))
    assert ks["s2"].window == ks["s3"].window == (("main", "g2", 1.0),)
    assert ks["s4"].window == ()  # async, nothing scheduled beside it
    assert ks["ar5"].window is None  # synchronous
    # the loop between s6's start and done: its body's GEMM and counter TRIPS times per run of s6
    # (the condition's compare too; the predicate read-back is no compute)
    assert sorted(ks["s6"].window) == [("body", "gb", TRIPS), ("body", "next", TRIPS), ("cond", "lt", TRIPS)]
    assert "s1" in ks and "d1" not in ks  # the done half launches nothing


def test_exposed_collectives_and_the_step(costs):
    t = step_pricing.TARGETS["h100"]
    gemm, elem, ar = expected_times(t, costs)
    counter = (12 + 9) / t.hbm_bytes_per_s  # the loop's add (two s32 in, one out) and compare (pred out)
    ks = step_kernels.kernels(HLO)
    p = step_pricing.price(ks, t, costs)
    # The ring all-reduce of an f32 [R, C] over 2 GPUs takes longer than the GEMM and the negation
    # beside it and shorter than the loop's TRIPS GEMMs (the shapes are chosen so): s1 is exposed by
    # the difference, s2 and s3 share one GEMM, s6 hides entirely.
    assert gemm + elem < ar < TRIPS * gemm
    exposed = {"s1": ar - (gemm + elem), "s2": ar - gemm, "s3": ar, "s4": ar, "ar5": ar, "s6": 0.0}
    got = {r["name"]: r for r in p["collectives"]["by_kernel"]}
    assert set(got) == set(exposed)
    for name, want in exposed.items():
        assert math.isclose(got[name]["priced_s"], ar, rel_tol=1e-9), name
        assert math.isclose(got[name]["exposed_s"], want, rel_tol=1e-9, abs_tol=1e-15), (name, got[name], want)
    total = sum(exposed.values())
    assert math.isclose(p["collectives"]["exposed_s"], total, rel_tol=1e-9)
    assert math.isclose(p["collectives"]["priced_s"], 6 * ar, rel_tol=1e-9)
    assert math.isclose(p["time_by_category"]["collectives"], total, rel_tol=1e-9)
    assert math.isclose(p["no_overlap_step_s"] - p["predicted_step_s"], 6 * ar - total, rel_tol=1e-9)
    assert math.isclose(p["predicted_step_s"], sum(p["time_by_category"].values()), rel_tol=1e-12)
    root_add = 3 * R * C * 4 / t.hbm_bytes_per_s
    compute = 2 * gemm + elem + TRIPS * (gemm + counter) + root_add
    assert math.isclose(p["predicted_step_s"], compute + total, rel_tol=1e-9)
    assert got["ar5"]["async"] is False and got["s1"]["async"] is True
    text = step_command.to_text(step_pricing.summary(ks, p))
    assert "collectives priced" in text and "exposed" in text and "roofline" in text


def test_roofline_is_each_kernel_at_the_peaks(costs):
    """The step's roofline: every kernel at max(FLOPs / peak, HBM bytes / datasheet bandwidth), the
    collectives at their link bytes over the link bandwidth times their exposed share."""
    t = step_pricing.TARGETS["h100"]
    assert math.isclose(t.hbm_bytes_per_s, step_pricing.COPY_SHARE * 3.35e12) and t.hbm_peak() == 3.35e12
    ks = step_kernels.kernels(HLO)
    p = step_pricing.price(ks, t, costs)
    gemm = max(2.0 * M * N * K / 989e12, 2 * (M * K + K * N + M * N) / 3.35e12)
    elem = 2 * R * C * 4 / 3.35e12
    counter = (12 + 9) / 3.35e12
    link = R * C * 4 / 360e9  # 2 (n-1)/n of the payload, n = 2
    exposed = {r["name"]: r["exposed_s"] / r["priced_s"] for r in p["collectives"]["by_kernel"]}
    want = {
        "gemm": 2 * gemm + TRIPS * gemm,
        "elementwise": elem + TRIPS * counter + R * C * 4 * 3 / 3.35e12,  # e1, next/lt, the root add
        "collectives": link * sum(exposed.values()),
    }
    for cat, value in want.items():
        assert math.isclose(p["roofline_by_category"][cat], value, rel_tol=1e-9), (cat, p["roofline_by_category"])
    assert math.isclose(p["roofline_step_s"], sum(want.values()), rel_tol=1e-9)
    assert math.isclose(p["collectives"]["roofline_s"], 6 * link, rel_tol=1e-9)
    assert p["roofline_step_s"] < p["predicted_step_s"]


@needs_aot
def test_a_deviceless_tensor_parallel_program():
    """A two-layer tensor-parallel MLP (shard_map over 4 deviceless H100s, each layer's output
    all-reduced) and its gradient: every async collective's window is the kernels scheduled between
    its start and done lines of the optimized HLO (read here line by line), the exposed part of each
    is at most its price and at least its price less its window's compute, and the roofline is the
    sum over kernels of max(FLOPs / peak, bytes / bandwidth) plus the collectives' exposed share."""
    import re
    from functools import partial

    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from boost_jax.kernels import platform

    devs = aot.devices("h100", 4)
    mesh = Mesh(np.array(devs), ("tensor",))
    d, f, m = 512, 2048, 1024

    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(None, "tensor"), P("tensor", None)), out_specs=P())
    def mlp(x, w1, w2):
        for _ in range(2):
            x = jax.lax.psum(jax.nn.gelu(x @ w1) @ w2, "tensor") + x
        return x

    def loss(x, w1, w2):
        return jnp.sum(mlp(x, w1, w2).astype(jnp.float32) ** 2)

    def sharded(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))

    args = [sharded((m, d), P()), sharded((d, f), P(None, "tensor")), sharded((f, d), P("tensor", None))]
    with platform.target(devs[0]):
        text = jax.jit(jax.grad(loss, argnums=(1, 2))).lower(*args).compile().as_text()
    ks = step_kernels.kernels(text)
    t = step_pricing.TARGETS["h100"]
    p = step_pricing.price(ks, t)
    colls = [k for k in ks if k.kind == "collective"]
    assert colls and any(k.window for k in colls)
    by_key = {(k.computation, k.name): k for k in ks}
    for k in colls:
        if k.window is None:
            continue
        lines = [ln.strip() for ln in text.splitlines()]
        start = next(i for i, ln in enumerate(lines) if ln.startswith(f"%{k.name} = "))
        done = next(i for i, ln in enumerate(lines) if i > start and re.search(rf"-done\(%{re.escape(k.name)}\)", ln))
        between = [re.match(r"(?:ROOT )?%([\w.\-]+) = ", ln).group(1) for ln in lines[start + 1 : done]]
        compute = {
            n for n in between if (k.computation, n) in by_key and by_key[(k.computation, n)].kind != "collective"
        }
        assert {name for _, name, _ in k.window} == compute
    rows = {r["name"]: r for r in p["collectives"]["by_kernel"]}
    for k in colls:
        r = rows[k.name]
        window = sum(by_key[(c, n)].total_s() * runs / by_key[(c, n)].count for c, n, runs in k.window or ())
        assert math.isclose(r["priced_s"], k.total_s())
        assert max(0.0, k.total_s() - window) - 1e-12 <= r["exposed_s"] <= k.total_s() + 1e-12
    assert p["collectives"]["overlapped_s"] > 0  # the latency-hiding scheduler put compute beside some
    roof = sum(
        max(kk.flops / t.bf16_flops / (0.5 if kk.kind == "gemm" and kk.gemm[4] == "f32" else 1), kk.bytes / 3.35e12)
        * kk.count
        for kk in ks
        if kk.kind not in ("collective", "sync")
    )
    roof += sum(
        rows[kk.name]["exposed_s"] / rows[kk.name]["priced_s"] * kk.collective["wire_bytes"] / 360e9 * kk.count
        for kk in colls
        if rows[kk.name]["priced_s"]
    )
    assert math.isclose(p["roofline_step_s"], roof, rel_tol=1e-9)


def test_a_cast_then_sliced_stack_reads_its_slice():
    """A fusion that casts a stacked float32 weight [L, m, n] to bf16 and slices one layer out reads
    that layer's float32 slice (the fusion computes only the elements it writes), not the stack; a
    cast that is the fusion's output reads everything."""
    L, m, n = 8, 256, 384
    text = f"""HloModule m, is_scheduled=true

%cast_slice (p: f32[{L},{m},{n}]) -> bf16[1,{m},{n}] {{
  %p = f32[{L},{m},{n}]{{2,1,0}} parameter(0)
  %c = bf16[{L},{m},{n}]{{2,1,0}} convert(%p)
  ROOT %s = bf16[1,{m},{n}]{{2,1,0}} slice(%c), slice={{[3:4], [0:{m}], [0:{n}]}}
}}

%cast_all (p: f32[{L},{m},{n}]) -> bf16[{L},{m},{n}] {{
  %p = f32[{L},{m},{n}]{{2,1,0}} parameter(0)
  ROOT %c = bf16[{L},{m},{n}]{{2,1,0}} convert(%p)
}}

ENTRY %main (w: f32[{L},{m},{n}]) -> (bf16[1,{m},{n}], bf16[{L},{m},{n}]) {{
  %w = f32[{L},{m},{n}]{{2,1,0}} parameter(0)
  %one = bf16[1,{m},{n}]{{2,1,0}} fusion(%w), kind=kLoop, calls=%cast_slice
  %all = bf16[{L},{m},{n}]{{2,1,0}} fusion(%w), kind=kLoop, calls=%cast_all
  ROOT %t = (bf16[1,{m},{n}]{{2,1,0}}, bf16[{L},{m},{n}]{{2,1,0}}) tuple(%one, %all)
}}
"""
    ks = {k.name: k for k in step_kernels.kernels(text)}
    assert ks["one"].bytes == m * n * 4 + m * n * 2
    assert ks["all"].bytes == L * m * n * 4 + L * m * n * 2
