"""tools/step_profile/: kernels read from compiled GPU programs, priced, grouped; measured traces
grouped the same way; the fitted table within 15% of every measured H100 row."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from boost_jax.tools import aot
from boost_jax.tools.step_profile import categories as step_categories
from boost_jax.tools.step_profile import command as step_command
from boost_jax.tools.step_profile import kernels as step_kernels
from boost_jax.tools.step_profile import pricing as step_pricing
from boost_jax.tools.step_profile import traces as step_traces

ROOT = Path(__file__).resolve().parents[1]
needs_aot = pytest.mark.skipif(not aot.available(), reason=f"needs the aot extra ({aot.missing()})")

# A GPU-shaped module written by hand: a while loop of 5 trips whose body slices a row out of a
# [10, 128] buffer, runs a Triton GEMM and writes the row back in place; after it an all-reduce over
# 2 devices and a copy. Every number below is computed from these shapes, not read from the parser.
TRIPS, ROWS, COLS, M, K, N = 5, 10, 128, 64, 128, 256
HLO = f"""HloModule jit_step, entry_computation_layout={{(f32[{ROWS},{COLS}]{{1,0}})->f32[{ROWS},{COLS}]{{1,0}}}}, num_partitions=2

%fused_ds (p0: f32[{ROWS},{COLS}], p1: s32[]) -> f32[1,{COLS}] {{
  %p0 = f32[{ROWS},{COLS}]{{1,0}} parameter(0)
  %p1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  ROOT %ds = f32[1,{COLS}]{{1,0}} dynamic-slice(%p0, %p1, %c0), dynamic_slice_sizes={{1,{COLS}}}
}}

%fused_dus (p0: f32[{ROWS},{COLS}], p1: s32[], p2: f32[1,{COLS}]) -> f32[{ROWS},{COLS}] {{
  %p0 = f32[{ROWS},{COLS}]{{1,0}} parameter(0)
  %p2 = f32[1,{COLS}]{{1,0}} parameter(2)
  %neg = f32[1,{COLS}]{{1,0}} negate(%p2)
  %p1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  ROOT %dus = f32[{ROWS},{COLS}]{{1,0}} dynamic-update-slice(%p0, %neg, %p1, %c0)
}}

%gemm_comp (a: bf16[{M},{K}], b: bf16[{K},{N}]) -> bf16[{M},{N}] {{
  %a = bf16[{M},{K}]{{1,0}} parameter(0)
  %b = bf16[{K},{N}]{{1,0}} parameter(1)
  ROOT %dot = bf16[{M},{N}]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%body (param: (s32[], f32[{ROWS},{COLS}], bf16[{M},{K}], bf16[{K},{N}])) -> (s32[], f32[{ROWS},{COLS}], bf16[{M},{K}], bf16[{K},{N}]) {{
  %param = (s32[], f32[{ROWS},{COLS}]{{1,0}}, bf16[{M},{K}]{{1,0}}, bf16[{K},{N}]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %buf = f32[{ROWS},{COLS}]{{1,0}} get-tuple-element(%param), index=1
  %a = bf16[{M},{K}]{{1,0}} get-tuple-element(%param), index=2
  %b = bf16[{K},{N}]{{1,0}} get-tuple-element(%param), index=3
  %row = f32[1,{COLS}]{{1,0}} fusion(%buf, %i), kind=kLoop, calls=%fused_ds
  %g = bf16[{M},{N}]{{1,0}} fusion(%a, %b), kind=kCustom, calls=%gemm_comp, backend_config={{"fusion_backend_config":{{"kind":"__triton_gemm"}}}}
  %upd = f32[{ROWS},{COLS}]{{1,0}} fusion(%buf, %i, %row), kind=kLoop, calls=%fused_dus
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[{ROWS},{COLS}]{{1,0}}, bf16[{M},{K}]{{1,0}}, bf16[{K},{N}]{{1,0}}) tuple(%next, %upd, %a, %b)
}}

%cond (param: (s32[], f32[{ROWS},{COLS}], bf16[{M},{K}], bf16[{K},{N}])) -> pred[] {{
  %param = (s32[], f32[{ROWS},{COLS}]{{1,0}}, bf16[{M},{K}]{{1,0}}, bf16[{K},{N}]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %n = s32[] constant({TRIPS})
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

%add_comp (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}}

ENTRY %main (x: f32[{ROWS},{COLS}], a: bf16[{M},{K}], b: bf16[{K},{N}]) -> f32[{ROWS},{COLS}] {{
  %x = f32[{ROWS},{COLS}]{{1,0}} parameter(0)
  %a = bf16[{M},{K}]{{1,0}} parameter(1)
  %b = bf16[{K},{N}]{{1,0}} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[{ROWS},{COLS}]{{1,0}}, bf16[{M},{K}]{{1,0}}, bf16[{K},{N}]{{1,0}}) tuple(%zero, %x, %a, %b)
  %w = (s32[], f32[{ROWS},{COLS}]{{1,0}}, bf16[{M},{K}]{{1,0}}, bf16[{K},{N}]{{1,0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"{TRIPS}"}}}}
  %out = f32[{ROWS},{COLS}]{{1,0}} get-tuple-element(%w), index=1
  %ar = f32[{ROWS},{COLS}]{{1,0}} all-reduce-start(%out), replica_groups={{{{0,1}}}}, to_apply=%add_comp
  %ard = f32[{ROWS},{COLS}]{{1,0}} all-reduce-done(%ar)
  ROOT %cp = f32[{ROWS},{COLS}]{{1,0}} copy(%ard)
}}
"""


def by_name(ks):
    return {k.name: k for k in ks}


def test_kernels_of_a_hand_written_loop():
    ks = by_name(step_kernels.kernels(HLO))
    row, buf = COLS * 4, ROWS * COLS * 4
    assert set(ks) == {"row", "g", "upd", "next", "lt", "ar", "cp", "cond (loop predicate)"}
    # The loop body runs TRIPS times; the condition's compare too; entry kernels once.
    assert {n: k.count for n, k in ks.items()} == {
        "row": TRIPS,
        "g": TRIPS,
        "upd": TRIPS,
        "next": TRIPS,
        "lt": TRIPS,
        "ar": 1,
        "cp": 1,
        "cond (loop predicate)": TRIPS,
    }
    # The GEMM: 2 m n k from its shapes; bytes its operands and output.
    g = ks["g"]
    assert (g.kind, g.gemm[:4], g.flops) == ("gemm", (1, M, N, K), 2.0 * M * N * K)
    assert g.bytes == 2 * (M * K + K * N + M * N)
    # A dynamic slice reads the row it slices (and its s32 index), not the buffer.
    assert ks["row"].bytes == row + 4 + row
    # An update in place writes the row: the buffer is neither read nor rewritten.
    assert ks["upd"].bytes == 4 + row + row
    # The all-reduce moves 2 (n-1)/n of its payload over the link in 2 (n-1) steps.
    c = ks["ar"].collective
    assert (c["kind"], c["group_size"], c["payload_bytes"], c["wire_bytes"], c["steps"]) == (
        "all-reduce",
        2,
        buf,
        buf,
        2,
    )
    assert ks["cp"].bytes == 2 * buf
    assert {n: k.category for n, k in ks.items()} == {
        "row": "copies/layout",
        "g": "gemm",
        "upd": "elementwise",
        "next": "elementwise",
        "lt": "elementwise",
        "ar": "collectives",
        "cp": "copies/layout",
        "cond (loop predicate)": "launch",
    }


def test_price_is_max_of_compute_and_memory_plus_launches():
    rng = np.random.default_rng(0)
    eff = {c: float(rng.uniform(0.3, 0.9)) for c in step_pricing.GEMM_CLASSES}
    c = step_pricing.Costs(eff, float(rng.uniform(0.2, 0.6)), float(rng.uniform(1e-6, 9e-6)))
    t = step_pricing.TARGETS["h100"]
    ks = step_kernels.kernels(HLO)
    p = step_pricing.price(ks, "h100", c)
    g = by_name(ks)["g"]
    want_g = max(2.0 * M * N * K / (t.bf16_flops * eff["medium"]), g.bytes / t.hbm_bytes_per_s)
    assert step_pricing.gemm_class(g.gemm) == "medium" and math.isclose(g.time_s, want_g)
    ar = by_name(ks)["ar"]
    assert math.isclose(ar.time_s, ROWS * COLS * 4 / t.link_bytes_per_s + 2 * t.link_latency_s)
    launches = sum(k.count for k in ks)
    assert p["launches"] == launches
    assert math.isclose(p["time_by_category"]["launch"], launches * c.launch_s)
    memory = sum(k.bytes * k.count for k in ks if k.kind not in ("gemm", "collective", "attention"))
    assert math.isclose(
        p["time_by_category"]["elementwise"] + p["time_by_category"]["copies/layout"], memory / t.hbm_bytes_per_s
    )
    assert math.isclose(p["predicted_step_s"], sum(p["time_by_category"].values()))


def test_attention_time_grows_with_keys_and_adds_the_backward_side_passes():
    """cuDNN attention priced as its FLOPs at efficiency x keys / (keys + half_keys) of peak, the backward
    plus its side passes (14 bytes per query element at the copy bandwidth); a flat efficiency when
    half_keys is 0; and the fit's curve passes through both measured kernels it is drawn through."""
    rng = np.random.default_rng(1)
    t = step_pricing.TARGETS["h200"]
    eff, half = float(rng.uniform(0.3, 0.6)), float(rng.uniform(100, 2000))
    b, h, sq, d = 4, 8, 256, 64
    c = step_pricing.Costs({k: 0.5 for k in step_pricing.GEMM_CLASSES}, eff, 0.0, attention_half_keys=half)
    for sk in (256, 4096):
        for backward in (False, True):
            flops = 4.0 * b * h * sq * sk * d * (2.5 if backward else 1.0) * 0.5
            k = step_kernels.Kernel("a", "custom-call", "attention", 1, flops=flops, bytes=1.0)
            k.attention = (b, h, sq, sk, d, backward, True)
            want = flops / (t.bf16_flops * eff * sk / (sk + half))
            want += 14.0 * b * sq * h * d / t.hbm_bytes_per_s if backward else 0.0
            assert math.isclose(step_pricing.kernel_time(k, t, c), want)
            flat = step_pricing.Costs(c.gemm_efficiency, eff, 0.0)
            assert math.isclose(
                step_pricing.kernel_time(k, t, flat) - (want - flops / (t.bf16_flops * eff * sk / (sk + half))),
                flops / (t.bf16_flops * eff),
            )
    fit = _fit_module()
    e, hk = fit.attention_curve()
    for keys, measured in fit.ATTENTION_MEASURED:
        assert math.isclose(e * keys / (keys + hk), measured)


def _custom_calls_hlo(m, n, k, name):
    """An entry of two Triton custom calls on [m, k] x [k, n] bf16: one named by kernels/priced.py, one not."""
    a, b, o = f"bf16[{m},{k}]{{1,0}}", f"bf16[{k},{n}]{{1,0}}", f"bf16[{m},{n}]{{1,0}}"
    cfg = 'backend_config={debug = false, grid_x = 8 : i32, grid_y = 1 : i32, grid_z = 1 : i32, name = "%s"}'
    return f"""HloModule jit_step, entry_computation_layout={{({a}, {b})->{o}}}

ENTRY %main (a: {a}, b: {b}) -> {o} {{
  %a = {a} parameter(0)
  %b = {b} parameter(1)
  %named = {o} custom-call(%a, %b), custom_call_target="__gpu$xla.gpu.triton", {cfg % name}
  ROOT %plain = {o} custom-call(%a, %named), custom_call_target="__gpu$xla.gpu.triton", {cfg % "other_fwd"}
}}
"""


def test_a_kernel_that_names_its_gemm_is_priced_as_that_gemm():
    """A Pallas/Triton call named by kernels/priced.py carries 2 b m n k FLOPs and is priced as an XLA
    GEMM of its shape class (max of compute at the class's efficiency and bytes); one without the
    tag keeps 0 FLOPs and is priced by its bytes."""
    from boost_jax.kernels.priced import gemm_name, gemm_shape

    rng = np.random.default_rng()
    m, n, k = (int(x) for x in rng.integers(17, 3000, size=3))
    name = gemm_name("gated_gemm_fwd", 1, m, n, k)
    assert gemm_shape(name) == (1, m, n, k) and gemm_shape("gate_fwd") is None
    ks = by_name(step_kernels.kernels(_custom_calls_hlo(m, n, k, name)))
    named, plain = ks["named"], ks["plain"]
    assert (named.kind, named.gemm, named.flops, named.category) == (
        "gemm",
        (1, m, n, k, "bf16"),
        2.0 * m * n * k,
        "gemm",
    )
    assert named.bytes == 2 * (m * k + k * n + m * n) and plain.bytes == 2 * (m * k + 2 * m * n)
    assert (plain.kind, plain.flops) == ("custom", 0.0)
    eff = {c: float(rng.uniform(0.3, 0.9)) for c in step_pricing.GEMM_CLASSES}
    c = step_pricing.Costs(eff, 0.4, 0.0)
    t = step_pricing.TARGETS["h100"]
    step_pricing.price(list(ks.values()), "h100", c)
    cls = "large" if min(m, n, k) > step_pricing.LARGE_DIM else "medium"
    want = max(2.0 * m * n * k / (t.bf16_flops * eff[cls]), named.bytes / t.hbm_bytes_per_s)
    assert math.isclose(named.time_s, want) and math.isclose(plain.time_s, plain.bytes / t.hbm_bytes_per_s)
    roof = max(2.0 * m * n * k / t.bf16_flops, named.bytes / t.hbm_peak())
    assert math.isclose(step_pricing.roofline_time(named, t), roof)


def test_gemm_classes():
    assert step_pricing.gemm_class((1, 8192, 32000, 2048, "bf16")) == "large"
    assert step_pricing.gemm_class((1, 8192, 512, 2048, "bf16")) == "medium"
    assert step_pricing.gemm_class((1, 8192, 2048, 1024, "bf16")) == "medium"
    assert step_pricing.gemm_class((3, 8192, 2048, 2048, "bf16")) == "batched"


def test_remat_clones_are_priced_at_their_share():
    """A clone XLA's rematerialization made (NAME.remat, NAME.remat2) costs `remat_clone_share` of its
    time; the price says what the clones would add in full."""
    text = HLO.replace("%upd = ", "%upd.remat2 = ").replace("(%next, %upd, %a, %b)", "(%next, %upd.remat2, %a, %b)")
    ks = step_kernels.kernels(text)
    assert [k.name for k in ks if k.remat_clone] == ["upd.remat2"] and not step_kernels.remat_clone(
        "upd.rematerialized"
    )
    for share in (0.0, 0.5, 1.0):
        c = step_pricing.Costs({k: 0.5 for k in step_pricing.GEMM_CLASSES}, 0.4, 2e-6, share)
        p, full = (
            step_pricing.price(ks, "h100", c),
            step_pricing.price(ks, "h100", step_pricing.Costs(c.gemm_efficiency, 0.4, 2e-6, 1.0)),
        )
        clone = next(k for k in ks if k.remat_clone)
        assert math.isclose(
            full["predicted_step_s"] - p["predicted_step_s"], (1 - share) * (clone.total_s() + clone.count * 2e-6)
        )
        assert math.isclose(p["remat_clones"]["time_s"], clone.total_s() + clone.count * 2e-6)


@pytest.mark.parametrize(
    "kernel, category",
    [
        (
            {
                "kind": "fusion",
                "opcode": "fusion",
                "source": "boost_jax/kernels/rmsnorm.py:rmsnorm_reference:74",
                "fused": ("multiply", "reduce"),
            },
            "norm",
        ),
        ({"kind": "custom", "opcode": "custom-call", "backend": "__gpu$xla.gpu.triton rmsnorm_fwd"}, "norm"),
        (  # the add + norm kernels of a GEMM that normalises its rows (its GEMMs stay GEMMs)
            {"kind": "custom", "opcode": "custom-call", "source": "boost_jax/kernels/norm_gemm.py:_stats:119"},
            "norm",
        ),
        ({"kind": "gemm", "opcode": "custom-call", "source": "boost_jax/kernels/norm_gemm.py:_kernel:98"}, "gemm"),
        (
            {
                "kind": "fusion",
                "opcode": "fusion",
                "source": "boost_jax/model/loss.py:token_losses:22",
                "fused": ("exponential", "reduce"),
            },
            "loss",
        ),
        ({"kind": "gemm", "opcode": "fusion", "source": "boost_jax/model/loss.py:logits_of:30"}, "gemm"),
        (
            {
                "kind": "fusion",
                "opcode": "fusion",
                "source": "boost_jax/runtime/step.py:optimizer_update:104",
                "fused": ("multiply", "sqrt"),
            },
            "optimizer",
        ),
        ({"kind": "fusion", "opcode": "fusion", "source": "optax/_src/transform.py:update_moment:90"}, "optimizer"),
        (
            {
                "kind": "fusion",
                "opcode": "fusion",
                "source": "boost_jax/model/transformer.py:Transformer.hidden:129",
                "fused": ("bitcast", "dynamic-update-slice", "parameter"),
            },
            "copies/layout",
        ),
        (
            {
                "kind": "fusion",
                "opcode": "fusion",
                "source": "boost_jax/model/transformer.py:MLP.__call__:42",
                "fused": ("exponential", "multiply", "parameter"),
            },
            "elementwise",
        ),
        ({"kind": "attention", "opcode": "custom-call", "backend": "__cudnn$fmhaSoftmax"}, "attention"),
        ({"kind": "collective", "opcode": "all-gather-start"}, "collectives"),
        ({"kind": "op", "opcode": "transpose"}, "copies/layout"),
    ],
)
def test_categorize(kernel, category):
    assert step_categories.categorize(kernel) == category


def test_measured_groups_trace_events_by_the_same_categories():
    """A synthetic trace of the hand-written program: each kernel's events take its HLO instruction's
    category; events naming no instruction go by kernel name; the idle rest of the step is launch."""
    rng = np.random.default_rng(1)
    expect = dict.fromkeys(step_categories.CATEGORIES, 0.0)
    own = {
        "row": "copies/layout",
        "g": "gemm",
        "upd": "elementwise",
        "next": "elementwise",
        "lt": "elementwise",
        "ar": "collectives",
        "cp": "copies/layout",
    }
    events, steps = [], 3
    for op, cat in own.items():
        for kernel in (f"{op}_kernel", f"{op}_kernel_2")[: 1 + (op == "g")]:  # a GEMM may launch two kernels
            us = float(rng.uniform(1, 500))
            events.append(
                {"name": kernel, "hlo_op": op, "hlo_module": "jit_step", "duration_us": us, "count": steps * TRIPS}
            )
            expect[cat] += us / 1e6 / steps
    for name, cat in (
        ("ncclDevKernel_AllGather_RING_LL", "collectives"),
        ("sm90_xmma_gemm_bf16bf16", "gemm"),
        ("Memcpy DtoH", "copies/layout"),
        ("some_fusion", "elementwise"),
    ):
        us = float(rng.uniform(1, 50))
        events.append({"name": name, "hlo_op": "", "hlo_module": "", "duration_us": us, "count": steps})
        expect[cat] += us / 1e6 / steps
    busy = sum(expect.values())
    step_s = busy * 1.25
    got = step_traces.measured({"steps": steps, "step_s": step_s, "events": events}, HLO)
    expect["launch"] += step_s - busy
    for cat in step_categories.CATEGORIES:
        assert math.isclose(got["time_by_category"][cat], expect[cat], rel_tol=1e-9, abs_tol=1e-15), cat
    assert math.isclose(got["step_s"], step_s) and math.isclose(got["busy_s"], busy)
    with pytest.raises(ValueError, match="duration_us"):
        step_traces.measured([{"name": "x", "hlo_op": "g", "duration": 3}], HLO)
    # Other units and `kernel` for the name read the same.
    other = [
        {"kernel": e["name"], "hlo_op": e["hlo_op"], "duration_ns": e["duration_us"] * 1e3, "count": e["count"]}
        for e in events
    ]
    again = step_traces.measured({"steps": steps, "step_s": step_s, "events": other}, HLO)
    for cat in step_categories.CATEGORIES:
        assert math.isclose(again["time_by_category"][cat], expect[cat], rel_tol=1e-9, abs_tol=1e-15), cat


def test_trace_events_of_a_cpu_trace(tmp_path):
    """jax.profiler on this host: the events name the program's HLO ops and module; their summed time
    is what `measured` groups (a CPU program's kernels, the same functions as on a GPU)."""
    import glob

    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x, w: jnp.tanh(x @ w).sum())
    x = w = jnp.ones((128, 128))
    compiled = f.lower(x, w).compile()
    compiled(x, w).block_until_ready()
    jax.profiler.start_trace(str(tmp_path))
    for _ in range(3):
        compiled(x, w).block_until_ready()
    jax.profiler.stop_trace()
    path = glob.glob(str(tmp_path / "**" / "*.xplane.pb"), recursive=True)[0]
    text = compiled.as_text()
    rows = step_traces.trace_events(path, step_traces.module_name(text))
    assert rows and all(r["hlo_module"].startswith(step_traces.module_name(text)) for r in rows)
    assert sum(r["count"] for r in rows) >= 3 and all(r["duration_us"] >= 0 for r in rows)
    got = step_traces.measured({"steps": 3, "events": rows}, text)
    assert math.isclose(sum(got["time_by_category"].values()), sum(r["duration_us"] for r in rows) / 3e6)


@needs_aot
def test_kernels_of_a_deviceless_h100_scan():
    """A scan of L GEMMs compiled for an H100: the priced GEMM FLOPs are L x 2 m n k whatever XLA does
    to the loop and the GEMM (double buffering, split-K), and the fusion that stacks each layer's
    output in place reads its other operands and writes one [m, n] slice, not the [L, m, n] stack."""
    import re

    import jax
    import jax.numpy as jnp

    from boost_jax.kernels import platform

    L, m, k, n = 6, 256, 384, 512
    dev = aot.devices("h100", 1)[0]

    def f(x, ws):
        def layer(h, w):
            y = jnp.tanh(h @ w)
            return y[:, :k], y

        return jax.lax.scan(layer, x, ws)

    with platform.target(dev):
        args = [platform.abstract((m, k), jnp.bfloat16), platform.abstract((L, k, n), jnp.bfloat16)]
        text = jax.jit(f).lower(*args).compile().as_text()
    ks = step_kernels.kernels(text)
    assert sum(kk.flops * kk.count for kk in ks if kk.category == "gemm") == L * 2 * m * n * k
    (stack,) = [kk for kk in ks if "dynamic-update-slice" in kk.fused]
    assert stack.count * (2 if "double_buffer" in text else 1) >= L
    comp = re.search(r"calls=%([\w.\-]+)", next(ln for ln in text.splitlines() if f"%{stack.name} = " in ln)).group(1)
    params = re.search(rf"^%{re.escape(comp)} \((.*?)\) ->", text, re.M).group(1)
    shapes = re.findall(r"(bf16|f32|s32)\[([\d,]*)\]", params)
    size = {"bf16": 2, "f32": 4, "s32": 4}
    nbytes = [size[t] * int(np.prod([int(d) for d in dims.split(",") if d])) for t, dims in shapes]
    buffer = nbytes[0]
    assert buffer == L * m * n * 2  # the stack, operand 0: updated in place
    assert stack.bytes == sum(nbytes[1:]) + m * n * 2


MEASURED = json.loads((ROOT / "benchmarks" / "h100_measured.json").read_text())


def _fit_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step_profile_fit

    return step_profile_fit


def test_every_measured_h100_row_within_15_percent(capsys):
    """`python benchmarks/step_profile_fit.py --check` (the README's command): the committed constants
    (boost_jax/tools/targets/step_costs.json) price every measured H100 row, fitted and held out, within
    15% from its compiled program (benchmarks/hlo/: the deviceless H100 compile of that row), and keep
    the measured orders (remat none slower than lowrank, grouped slower than ungrouped on one GPU, the
    fused norms faster than XLA's)."""
    fit = _fit_module()
    c = step_pricing.costs("h100")
    assert set(c.fitted_on) == {r["name"] for r in MEASURED["rows"] if r["fit"]}
    assert {r["name"] for r in MEASURED["rows"] if not r["fit"]}  # some rows are held out
    result = fit.main(["--check"])
    assert "| row | set | measured ms | predicted ms | ratio |" in capsys.readouterr().out
    for r, m in zip(result["rows"], MEASURED["rows"]):
        assert r["name"] == m["name"] and r["measured_ms"] == m["step_ms"]
        assert abs(r["predicted_ms"] / m["step_ms"] - 1) <= 0.15, (r["name"], r["predicted_ms"], m["step_ms"])
    assert len(result["orders"]) == len(MEASURED["orders"]) and all(o["kept"] for o in result["orders"])


def test_every_measured_h200_row_within_15_percent():
    """`python benchmarks/step_profile_fit.py --measured benchmarks/h200_measured.json --target h200
    --check`: the H100-fitted constants, with the H200's bandwidth, price each of the 9 rows measured on
    one H200 (none fitted on) within 15% from its deviceless H200 compile (benchmarks/hlo/h200_*)."""
    fit = _fit_module()
    measured = json.loads((ROOT / "benchmarks" / "h200_measured.json").read_text())
    assert not any(r["fit"] for r in measured["rows"])
    result = fit.main(["--measured", str(ROOT / "benchmarks" / "h200_measured.json"), "--target", "h200", "--check"])
    for r, m in zip(result["rows"], measured["rows"]):
        assert r["name"] == m["name"] and abs(r["predicted_ms"] / m["step_ms"] - 1) <= 0.15, (r["name"], r["ratio"])


@needs_aot
@pytest.mark.slow  # two deviceless 1B compiles (~1-2 minutes): the cached programs are the code's
def test_fresh_compiles_within_15_percent():
    fit = _fit_module()
    c = step_pricing.costs("h100")
    for name in ("cola_1b lowrank 256", "llama_1b 256"):
        row = next(r for r in MEASURED["rows"] if r["name"] == name)
        ms = step_pricing.price(step_kernels.kernels(fit.compile_row(row, "h100")), "h100", c)["predicted_step_s"] * 1e3
        assert abs(ms / row["step_ms"] - 1) <= 0.15, (name, ms, row["step_ms"])


README_PROFILE = (
    "python -m boost_jax.tools.aot --target h100 --devices 1 --config configs/cola_1b.py --mesh 1,1,1,1 "
    "--train-only --profile --config.train.seq_len=256 --config.train.global_batch=32 "
    "--config.data.batching=stream"
)


@needs_aot
@pytest.mark.slow  # a full-size cola_1b compile (~1 minute)
def test_readme_profile_command(monkeypatch, capsys):
    """The README's `aot --profile` command, run from the repository root, prints its table; the
    program its measured row ran (cola_1b auto 256, 80.2 ms on one H100: XLA's gate product and σ,
    before the kernels that read them into the GEMMs) is priced within 15% of it."""
    monkeypatch.chdir(ROOT)
    argv = README_PROFILE.split()[3:]
    aot.main(argv)
    out = capsys.readouterr().out
    assert "train step time table: predicted step" in out and "  gemm " in out
    row = next(r for r in MEASURED["rows"] if r["name"] == "cola_1b auto 256")
    rep = aot.main([*argv, "--config.model.gate_kernel=xla", "--config.model.bottleneck_kernel=xla"])
    assert abs(rep["profile"]["predicted_step_s"] * 1e3 / row["step_ms"] - 1) <= 0.15


@needs_aot
def test_aot_profile_cli_json_and_table(tmp_path, capsys):
    """`tools.aot --profile` on the tiny model on 8 H100s (fsdp 8): the table printed, the JSON's time
    by category summing to its step, the collectives priced (one GPU: the README's command and the
    measured rows above)."""
    cfg = str(ROOT / "configs" / "tiny.py")
    for devices, mesh in ((8, "1,1,8,1"),):
        out = tmp_path / f"p{devices}.json"
        aot.main(
            [
                "--target",
                "h100",
                "--devices",
                str(devices),
                "--config",
                cfg,
                "--mesh",
                mesh,
                "--train-only",
                "--profile",
                "--json",
                str(out),
            ]
        )
        text = capsys.readouterr().out
        assert "train step time table: predicted step" in text and "top kernels:" in text
        p = json.loads(out.read_text())["profile"]
        assert set(p["time_by_category"]) == set(step_categories.CATEGORIES)
        assert math.isclose(p["predicted_step_s"], sum(p["time_by_category"].values()))
        assert p["time_by_category"]["gemm"] > 0 and p["top_kernels"]
        assert p["time_by_category"]["collectives"] > 0 and p["bytes_by_category"]["collectives"] > 0
        c = p["collectives"]  # the step at the collectives' exposed part; the bound without overlap kept
        assert 0 < c["exposed_s"] <= c["priced_s"] and math.isclose(c["priced_s"], c["overlapped_s"] + c["exposed_s"])
        assert math.isclose(p["time_by_category"]["collectives"], c["exposed_s"])
        assert math.isclose(p["no_overlap_step_s"], p["predicted_step_s"] + c["overlapped_s"])
        assert math.isclose(sum(r["priced_s"] for r in c["by_kernel"]), c["priced_s"])
        assert 0 < p["roofline_step_s"] < p["predicted_step_s"] and "roofline" in text
        assert math.isclose(p["roofline_step_s"], sum(p["roofline_by_category"].values()))
        assert json.loads(out.read_text())["xla_budget"] == "gpu"


def test_trace_script_on_this_host(tmp_path, capsys):
    """benchmarks/step_profile_trace.py as the README runs it on a GPU, here on this host's CPU with
    small widths: the program, the trace's kernels and the summary written; the measured table's
    categories sum to the measured step (the kernels' time plus the idle rest as launch); then
    `python -m boost_jax.tools.step_profile --hlo --events` prints both tables from the files."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step_profile_trace as trace

    size = dict(d_model=64, d_ff=128, n_heads=4, n_kv_heads=4, rank=16, vocab_size=256, n_layers=2, seq=32, batch=2)
    summary = trace.main(
        [
            "--out",
            str(tmp_path),
            "--rows",
            "cola_1b lowrank 256",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--size",
            json.dumps(size),
        ]
    )
    (row,) = summary["rows"]
    events = json.loads((tmp_path / "cola_1b_lowrank_256.events.json").read_text())
    assert events["steps"] == 2 and events["step_s"] > 0 and events["events"]
    assert all(e["hlo_module"].startswith(events["hlo_module"]) for e in events["events"] if e["hlo_module"])
    got = row["measured"]
    assert math.isclose(sum(got["time_by_category"].values()), max(got["busy_s"], events["step_s"]), rel_tol=1e-9)
    assert json.loads((tmp_path / "summary.json").read_text())["rows"][0]["name"] == "cola_1b lowrank 256"
    capsys.readouterr()
    out = step_command.main(
        [
            "--hlo",
            str(tmp_path / "cola_1b_lowrank_256.hlo.gz"),
            "--events",
            str(tmp_path / "cola_1b_lowrank_256.events.json"),
        ]
    )
    text = capsys.readouterr().out
    assert "predicted step" in text and "predicted ms" in text and "measured ms" in text
    assert math.isclose(out["measured"]["step_s"], got["step_s"])
    with pytest.raises(SystemExit):
        trace.main(["--out", str(tmp_path), "--rows", "no such row"])
    with pytest.raises(SystemExit):
        step_command.main(["--hlo", str(tmp_path / "missing.hlo")])
