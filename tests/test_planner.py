"""The parallelism planner (boost_jax/planner): α-β formulas, memory rejection, the search space, the
7B validation against BOOST's reported times (and the TP-4 fit's drift), search speed, pipeline
plans, its collectives against the HLO (st plans on 2 x 2 and 4 x 4 grids included) and its peak
memory against the compiled step's memory_analysis."""

import importlib.util
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from jax.sharding import Mesh as JaxMesh

from boost_jax.config import PROJECTION_GROUPS, base_config, sized_config
from boost_jax.planner import Layer, Link, Mesh, Options, load_cluster, plan_for, search
from boost_jax.planner.ops.operators import Coll, StMatmul
from boost_jax.planner.ops.strategy_tables import uniform_plan
from boost_jax.planner.pricing import cost
from boost_jax.planner.search_space import meshes, microbatch_counts, stage_counts
from boost_jax.planner.verify import compare

ROOT = Path(__file__).resolve().parents[1]
A100 = load_cluster(ROOT / "configs/clusters/a100_4x.py")
H100 = load_cluster(ROOT / "configs/clusters/h100_8x.py")


def test_alpha_beta_formulas():
    gb, beta, alpha = 1e9, 100e9, 1e-5
    # ring all-reduce over 4: 2*3/4 of the bytes on each link, 2*3 latency steps
    assert cost.collective_seconds("all-reduce", gb, 4, beta, alpha) == pytest.approx(0.015 + 6e-5)
    assert cost.collective_seconds("all-gather", gb, 4, beta, alpha) == pytest.approx(0.0075 + 3e-5)
    assert cost.collective_seconds("reduce-scatter", gb, 8, beta, alpha) == pytest.approx(7 / 8 * 0.01 + 7e-5)
    assert cost.collective_seconds("collective-permute", gb, 2, beta, alpha) == pytest.approx(0.01 + 1e-5)
    assert cost.collective_seconds("all-reduce", gb, 1, beta, alpha) == 0.0
    assert cost.link_bytes("all-reduce", gb, 4) == pytest.approx(1.5e9)


def test_link_is_picked_by_whether_the_group_spans_nodes():
    assert A100.link(1, 4) is A100.intra  # 4 consecutive GPUs: one A100 node
    assert A100.link(1, 8) is A100.inter and A100.link(4, 2) is A100.inter
    assert H100.link(1, 8) is H100.intra and H100.link(8, 8) is H100.inter
    ar = Coll("all-reduce", 1e9, 8, 1, "fwd")  # 2 GB of bf16 over 8 A100s: crosses Slingshot
    assert cost.coll_seconds(ar, A100, 2) == pytest.approx(2 * 7 / 8 * 2e9 / 20e9 + 14 * 20e-6)


def test_skinny_gemms_are_penalised():
    square = cost.gemm_efficiency(4096, 4096, 4096, A100)
    assert square == pytest.approx(A100.gemm_efficiency * (4096 / (4096 + 96)) ** 3)
    assert cost.gemm_efficiency(4096, 4096, 256, A100) < 0.8 * square


def test_plans_over_hbm_are_rejected():
    cfg = sized_config("7b", "cola")  # 2.8B params x 16 B of fp32 state: 45 GB on one 40 GB A100
    res = search(cfg, A100, 1, Options(batch=8, seq=256), flops_per_token=1.0)
    assert res.plans == [] and res.rejected_memory == res.considered > 0
    assert res.smallest.memory["states"] > A100.usable_hbm
    # On 8 GPUs some plans fit; none returned is over the usable HBM, and some were rejected.
    res = search(cfg, A100, 8, Options(batch=8, seq=4096), flops_per_token=1.0)
    assert res.plans and res.rejected_memory > 0
    assert all(p.memory["total"] <= A100.usable_hbm for p in res.plans)


def test_search_space_and_mesh_products():
    assert sorted((m.data, m.fsdp, m.tensor) for m in meshes(12)) == sorted(
        (d, f, 12 // (d * f)) for d in range(1, 13) for f in range(1, 13) if 12 % (d * f) == 0
    )
    assert sorted((m.pipeline, m.data * m.fsdp * m.tensor) for m in meshes(12, (1, 3))) == sorted(
        [(1, 12)] * 18 + [(3, 4)] * 6
    )
    assert stage_counts(64, 40, Options(batch=1, seq=1)) == [1, 2, 4, 8]  # divide devices and layers
    assert stage_counts(64, 40, Options(batch=1, seq=1, pipeline=(2, 3, 16))) == [2]
    assert microbatch_counts(1, 64, Options(batch=1, seq=1)) == [1]
    assert microbatch_counts(4, 24, Options(batch=1, seq=1)) == [4, 8]  # 16 does not split 24 rows
    # 16 devices: the whole 64-device space is the slow test below
    res = search(sized_config("7b", "cola"), H100, 16, Options(batch=512, seq=256, top=20), flops_per_token=1.0)
    assert len(res.plans) == 20
    assert all(p.mesh.devices == 16 for p in res.plans)
    assert res.plans == sorted(res.plans, key=lambda p: p.step_s)
    assert res.best_runnable is not None and res.best_runnable.runnable == "yes"
    assert "--config.parallel.strategy=" in res.best_runnable.overrides
    assert any(p.runnable.startswith("no:") for p in res.plans)  # mixed / st plans are flagged


# small spaces with pipelines (gpipe, circular, 1f1b, stage remat), context, st grids, HBM rejections; the 7B
# ones run under `pytest -m slow`
PRUNE_CASES = {
    "cola_7b on 8 H100": (sized_config("7b", "cola"), H100, 8, Options(batch=16, seq=256, top=5)),
    "cola_13b on 8 H100, pipelines": (sized_config("13b", "cola"), H100, 8, Options(batch=8, seq=256, top=3)),
    "llama_7b on 8 A100, seq 4096": (sized_config("7b", "dense"), A100, 8, Options(batch=8, seq=4096, top=3)),
    "cola_1b on 8 H100, context": (sized_config("1b", "cola"), H100, 8, Options(batch=2, seq=8192, top=4)),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if "7b" in c else c for c in PRUNE_CASES])
def test_the_pruned_search_returns_the_exhaustive_plans(case, monkeypatch):
    """Pricing in full only the plans whose lower bound can enter the result returns the same top plans
    and best runnable plan as pricing every plan, and the bound holds for every plan priced."""
    import dataclasses
    import sys

    from boost_jax.planner.pricing.whole_plan import lower_bound

    S = sys.modules["boost_jax.planner.search"]  # the module (the package exports its `search` function)
    cfg, cluster, devices, opts = PRUNE_CASES[case]
    cfg.model.max_seq_len = max(int(cfg.model.max_seq_len), opts.seq)
    pruned = search(cfg, cluster, devices, opts, flops_per_token=1.0)
    bounds = []
    price_plan = S.price_plan

    def checked(pr, mesh, accum, layer, fpt, *pipeline):
        plan = price_plan(pr, mesh, accum, layer, fpt, *pipeline)
        bounds.append((lower_bound(pr, mesh, accum, layer, *pipeline), plan.step_s, plan))
        return plan

    monkeypatch.setattr(S, "price_plan", checked)
    every = search(cfg, cluster, devices, dataclasses.replace(opts, prune=False), flops_per_token=1.0)

    def key(p):
        return (
            p.mesh,
            p.layer,
            p.remat,
            p.grad_accum,
            p.microbatches,
            p.schedule,
            p.repeats,
            p.stage_remat,
            p.context_attention,
            p.context_kv,
            p.unrolled,
            p.step_s,
            p.memory["total"],
        )

    assert [key(p) for p in pruned.plans] == [key(p) for p in every.plans] and len(every.plans) == opts.top
    assert key(pruned.best_runnable) == key(every.best_runnable)
    assert pruned.considered == every.considered == every.priced == len(bounds) > pruned.priced
    assert all(bound <= step * (1 + 1e-9) for bound, step, _ in bounds)
    priced = [p for _, _, p in bounds]  # the space the bounds were checked on
    if "pipelines" in case:
        assert {(p.schedule, p.stage_remat) for p in priced if p.mesh.pipeline > 1} == {
            ("gpipe", "none"),
            ("gpipe", "stage"),
            ("circular", "none"),
            ("circular", "stage"),
            ("1f1b", "none"),
            ("1f1b", "stage"),
        }
    if "context" in case:
        assert any(p.mesh.context > 1 for p in priced)


def test_the_unrolled_stack_is_searched_where_auto_unrolls():
    """Where only `data` splits the mesh, or `data` and `tensor` (remat none), the search also prices the
    unrolled stack (what the trainer's `auto` runs there): remat none priced on the cluster without its
    kept-activation term, the memory of the scanned remat-none stack, and flags that unroll it. Other
    meshes (fsdp, pipeline, context), and Options(unroll=False), keep scanned stacks only."""
    import dataclasses

    cfg = sized_config("60m", "cola")
    cluster = H100
    assert cluster.kept_passes > 0
    opts = Options(batch=16, seq=128, grad_accum=1, top=50)
    res = search(cfg, cluster, 2, opts)
    unrolled = [p for p in res.plans if p.unrolled]
    assert {p.mesh for p in unrolled} == {Mesh(2, 1, 1), Mesh(1, 1, 2)}
    assert all(p.remat == "none" for p in unrolled)
    assert all(p.mesh.fsdp * p.mesh.pipeline * p.mesh.context == 1 for p in unrolled)
    assert any(p.mesh.fsdp > 1 or p.mesh.pipeline > 1 for p in res.plans)  # searched, never unrolled
    u = next(p for p in unrolled if p.mesh == Mesh(2, 1, 1))
    assert "--config.remat.policy=none --config.model.scan_unroll=true" in u.overrides
    assert all(
        "--config.model.scan_unroll=false" in p.overrides for p in res.plans if p.runnable == "yes" and not p.unrolled
    )
    # the same plan priced by hand: scanned remat none on this cluster, and on one without the kept term
    scanned = plan_for(cfg, cluster, u.mesh, 1, "none", u.layer, opts)
    no_kept = plan_for(cfg, dataclasses.replace(cluster, kept_passes=0.0), u.mesh, 1, "none", u.layer, opts)
    assert math.isclose(u.step_s, no_kept.step_s) and u.step_s < scanned.step_s
    # its memory: the scanned stack's without the scan's double buffer, less what the unrolled program does
    # not keep (kept_arrays: each σ(A·x) keeps A's output and σ's, of 7 A outputs of the rank a layer; the
    # SwiGLU core gate, up and their product), the float32 gradient written into the kept activations each
    # layer's backward frees
    from boost_jax.planner.ops import kept_arrays as K

    m, tokens = cfg.model, 16 // 2 * 128
    fewer = (K.SAVED_SIGMA - K.GPU_UNROLLED_SIGMA) * 7 * m.rank + (
        K.GPU_SAVED_SWIGLU[0] - K.GPU_UNROLLED_SWIGLU
    ) * m.d_ff
    grads = scanned.memory["states"] / 4  # 16 bytes a parameter: its float32 gradient 4 of them
    assert u.memory["double_buffer"] == 0 < scanned.memory["double_buffer"]
    kept = scanned.memory["activations"] - m.n_layers * tokens * fewer * 2
    assert u.memory["activations"] == pytest.approx(max(kept - grads, 0))
    assert u.memory["states"] == scanned.memory["states"] and u.memory["total"] < scanned.memory["total"]
    assert not any(p.unrolled for p in search(cfg, cluster, 2, dataclasses.replace(opts, unroll=False)).plans)


@pytest.mark.slow  # ~1.5 min: the whole 64-device search space
def test_search_covers_64_devices_with_pipeline_stages():
    # (How long a search takes is printed by `python -m boost_jax.plan` ("... in N s"), not
    # asserted here: a loaded CI machine would make a timing assertion flaky.)
    res = search(sized_config("7b", "cola"), H100, 64, Options(batch=512, seq=4096), flops_per_token=1.0)
    assert res.plans
    # With pipeline stages and GPipe micro-batch counts in the space (13B: 40 layers, S in 1, 2, 4, 8).
    res = search(sized_config("13b", "cola"), H100, 64, Options(batch=512, seq=256, top=10), flops_per_token=1.0)
    assert res.considered > 10_000
    res = search(
        sized_config("13b", "cola"), H100, 64, Options(batch=512, seq=256, top=10, pipeline=(2, 4)), flops_per_token=1.0
    )
    piped = [p for p in res.plans if p.mesh.pipeline > 1]
    assert piped and all(p.mesh.devices == 64 and 40 % p.mesh.pipeline == 0 for p in piped)
    runnable = next(p for p in piped if p.runnable == "yes")
    assert (
        f"--config.parallel.pipeline={runnable.mesh.pipeline} --config.parallel.microbatches={runnable.microbatches} "
    ) in runnable.overrides
    assert (512 // runnable.grad_accum // (runnable.mesh.data * runnable.mesh.fsdp)) % runnable.microbatches == 0


@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_step_time_grows_with_the_bubble(stages):
    """Fewer GPipe micro-batches (same S, same batch): a bigger bubble, (S-1)/(M+S-1), and a slower step
    that tracks the ticks per micro-batch, (M+S-1)/M (bigger micro-batches run slightly better GEMMs)."""
    cfg, btp = sized_config("13b", "cola"), Layer(*uniform_plan("btp"))
    plans = [
        plan_for(cfg, H100, Mesh(2, 1, 4, stages), 1, "full", btp, Options(batch=512, seq=256), 1.0, m)
        for m in (4 * stages, 2 * stages, stages)
    ]
    assert [p.bubble for p in plans] == [(stages - 1) / (m + stages - 1) for m in (4 * stages, 2 * stages, stages)]
    assert plans[0].step_s < plans[1].step_s < plans[2].step_s
    ticks = (2 * stages - 1) / stages / ((5 * stages - 1) / (4 * stages))
    assert 0.8 * ticks < plans[2].step_s / plans[0].step_s < ticks
    assert all(p.shift_s > 0 and p.pipeline_colls[0].size == stages for p in plans)
    assert all(p.runnable == "yes" and "--config.parallel.pipeline=" in p.overrides for p in plans)


def test_pipeline_splits_a_model_too_big_for_one_gpu():
    """cola_13b's fp32 states (16 B/param) and the optimizer update's new state overflow one 80 GB
    H100; with 4 stages each GPU holds a quarter of the layers and the plan fits."""
    cfg, one = sized_config("13b", "cola"), Layer("R", ("none",) * 4, "R", "R")
    opts = Options(batch=8, seq=256, check_memory=False)
    flat = plan_for(cfg, H100, Mesh(1, 1, 1), 1, "full", one, opts, 1.0)
    piped = plan_for(cfg, H100, Mesh(1, 1, 1, 4), 1, "full", one, opts, 1.0)
    assert flat.memory["total"] > H100.usable_hbm >= piped.memory["total"]
    rest = (2 * 32000 * 5120 + 5120) * cost.ADAM_STATE_BYTES  # embedding, head, final norm: on every stage
    assert piped.memory["states"] - rest == pytest.approx((flat.memory["states"] - rest) / 4)
    # The search on 4 GPUs: the fitting plans split the parameters (pipeline, fsdp or tensor); pure
    # data parallelism (a whole replica per GPU) is rejected; pipeline plans are among those kept.
    res = search(cfg, H100, 4, Options(batch=8, seq=256, top=50), flops_per_token=1.0)
    assert res.plans and res.rejected_memory > 0
    assert all(p.mesh.data < 4 for p in res.plans)
    assert any(p.mesh.pipeline > 1 and p.runnable == "yes" for p in res.plans)


def load_validation():
    spec = importlib.util.spec_from_file_location("planner_validation", ROOT / "benchmarks/planner_validation.py")
    validation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(validation)
    return validation


def test_7b_validation_matches_boost_ordering_and_ratios():
    validation = load_validation()
    plans = validation.predict()
    t = {k: p.step_s for k, p in plans.items()}
    assert t["btp"] < t["megatron"] < t["vanilla"]  # full-rank Megatron slower than BTP, vanilla slowest
    assert validation.check(plans) == []  # each ratio to BTP within 30% of the reported one


def test_7b_tp4_fit_holds_within_10_percent():
    """The A100 constants fitted to BOOST's 7B TP-4 numbers still reproduce them (10%), the cluster
    file declares exactly those as fitted (and the kept passes it takes from the H100's fit), and a
    least-squares refit from the planner's own collectives lands on the file's bandwidth and latency.
    A 20% slower NVLink would fail."""
    validation = load_validation()
    assert {k for k, _ in A100.fitted} == {"intra_bandwidth", "intra_latency", "gemm_half_dim", "kept_passes"}
    # the H100's fitted constants are its step-time ones (tests/test_planner_time.py); the A100 takes the
    # H100's kept passes (the scanned stack's copies: the same program), fitted on no A100 step
    assert {k for k, _ in H100.fitted} <= {"gemm_efficiency", "flash_efficiency", "elementwise_passes", "kept_passes"}
    assert A100.kept_passes == H100.kept_passes > 0
    rows = validation.fitted_rows(A100)
    assert len(rows) == 4 and validation.check_fit(rows) == [], rows
    bandwidth, latency = validation.fit()
    assert bandwidth == pytest.approx(A100.intra.bandwidth, rel=0.10)
    assert latency == pytest.approx(A100.intra.latency, rel=0.10)
    import dataclasses

    slower = dataclasses.replace(A100, intra=Link(0.8 * A100.intra.bandwidth, A100.intra.latency))
    assert validation.check_fit(validation.fitted_rows(slower))
    from boost_jax.config import load_config_file
    from boost_jax.planner.pricing.cluster import from_dict

    bad = load_config_file(ROOT / "configs/clusters/a100_4x.py", "--cluster")
    bad.fitted = {"nvlink_bandwidth": "a typo"}
    with pytest.raises(ValueError, match="`fitted` names .*nvlink_bandwidth"):
        from_dict(bad)
    bad.fitted, bad.kept_passes = {}, -1.0  # an optional field, checked like the others
    with pytest.raises(ValueError, match="kept_passes must be a number >= 0"):
        from_dict(bad)


def test_btp_forward_traffic_is_7r_per_token():
    cfg = sized_config("7b", "cola")
    plan = plan_for(
        cfg,
        A100,
        Mesh(1, 1, 4),
        1,
        "none",
        Layer(*uniform_plan("btp")),
        Options(batch=4, seq=4096, check_memory=False),
        flops_per_token=1.0,
    )
    fwd = sum(c.elements for c in plan.layer_colls if c.phase == "fwd") / plan.tokens
    assert fwd == 7 * 1024 + 2  # + one norm statistic per token per norm (online RMSNorm)


def test_st_permutes_match_the_primitive():
    """StMatmul's permutes against one projection as the trainer runs it (boost_jax/model/linear.py):
    the input [B, T, k] on the (row, col) grid with the batch over rows, the weight skewed from its
    plain stored layout, forward + backward."""
    from boost_jax.parallel import spatial_temporal as st
    from boost_jax.tools.hlo_comm import parse_collectives

    b, t, k, n_out = 4, 16, 32, 48
    mesh = JaxMesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("row", "col"), axis_types=(AxisType.Auto,) * 2)
    grid = {"mesh": mesh, "row_axis": "row", "col_axis": "col"}
    kw = {**grid, "row_dim": 0}

    def f(i, w, g):
        o, vjp = jax.vjp(
            lambda a, v: st.st_matmul(
                st.skew_sharded(a, **kw), st.skew_weight_sharded(v, ("row", "col"), **grid), **kw
            ),
            i,
            w,
        )
        return (o, *vjp(g))

    act, weight = (
        NamedSharding(mesh, PartitionSpec("row", None, "col")),
        NamedSharding(mesh, PartitionSpec("row", "col")),
    )
    args = [
        jax.ShapeDtypeStruct((b, t, k), jnp.float32, sharding=act),
        jax.ShapeDtypeStruct((k, n_out), jnp.float32, sharding=weight),
        jax.ShapeDtypeStruct((b, t, n_out), jnp.float32, sharding=act),
    ]
    measured = parse_collectives(jax.jit(f).lower(*args).compile().as_text(), mesh)
    predicted = StMatmul(b * t / 2, k, n_out, 2, "W").colls()  # m: one device's tokens
    assert {c.kind for c in measured} == {"collective-permute"}
    assert len(measured) == len(predicted)
    assert sorted(c.elements for c in measured) == sorted(c.elements for c in predicted)


def test_verify_agrees_with_comm_report():
    """Predicted per-layer collective bytes against the HLO of the real train step's programs."""
    c = base_config()
    c.model.update(
        d_model=512, n_heads=8, n_kv_heads=8, d_ff=1376, rank=128, n_layers=2, vocab_size=1024, max_seq_len=64
    )
    rows = compare(c, A100, Mesh(1, 2, 2), "btp", batch=4, seq=64)
    assert [r["traffic"] for r in rows][:2] == ["tensor fwd: all-reduce", "tensor bwd: all-reduce"]
    check_verify_rows(rows, st=False, memory=False)


def with_overrides(cfg, flags: str):
    """cfg with the planner's `--config.key=value` flags applied (as the trainer's command line would)."""
    from boost_jax.validate import validate

    cfg = cfg.copy_and_resolve_references()
    for flag in flags.split():
        key, _, value = flag.removeprefix("--config.").partition("=")
        *parents, leaf = key.split(".")
        node = cfg
        for name in parents:
            node = node[name]
        old = node[leaf]
        auto_or_bool = isinstance(old, bool) or (old == "auto" and value in ("true", "false"))
        node[leaf] = value == "true" if auto_or_bool else type(old)(value)
    return validate(cfg)


# (linear, mesh, grad_accum, unrolled) of a top plan whose planner memory is over its CPU compile's by more
# than 20%: the unrolled data 2 x tensor 4 BTP step at one micro-batch, 13.3 GB priced, 9.5 GB compiled
# (float32; in the top 5 since the fsdp plans' per-layer traffic is priced, 2026-11-29 h-fsdptp; the
# data-replica program at one micro-batch and its memory are changing in another branch)
MEMORY_OVER = {("cola", "1x2x1x4", 1, True)}


@pytest.mark.parametrize("linear", ["cola", "dense"])
def test_runnable_top_plans_compile(linear):
    """Every top-5 plan marked runnable, and the best runnable plan with st groups on each strategy
    (mixed: btp/st/btp/btp for CoLA, megatron and megatron-SP around an st `o` for dense), builds
    the mesh and strategy it names and compiles as the trainer's step on 8 emulated devices (7B
    widths, 2 layers, abstract shapes); the planner's peak memory per device for each, priced for
    what the CPU compile runs (float32, chunked attention at seq 2048), is within 20% of the
    compiled step's memory_analysis (the btp plan 1x1x2x4 set BACKWARD_LIVE; the rest are held out)."""
    from boost_jax.runtime.build import build

    cfg = sized_config("7b", linear)
    cfg.model.n_layers = 2
    cfg.data.source = "embedded"
    # without context (its plans, compiled in tests/test_planner_context.py, take no st groups and
    # would crowd the st plans out of the top 60 here; the st plans gather and reduce their other groups
    # over fsdp in each layer pass, which ranks them below the top 30)
    res = search(cfg, A100, 8, Options(batch=16, seq=2048, top=60, context=(1,)), flops_per_token=1.0)
    plans = [p for p in res.plans[:5] if p.runnable == "yes"]
    with_st = {}
    for p in res.plans:
        if p.runnable == "yes" and "st" in p.layer.choices:
            with_st.setdefault((p.strategy, p.sequence_parallel), p)
    assert with_st, [str(p.layer) for p in res.plans]
    plans += [p for p in with_st.values() if p not in plans]
    for p in plans:
        run = with_overrides(cfg, p.overrides)
        built = build(run)
        mesh, strategy = built.mesh, built.strategy
        assert (mesh.shape["pipeline"], mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["tensor"]) == (
            p.mesh.pipeline,
            p.mesh.data,
            p.mesh.fsdp,
            p.mesh.tensor,
        )
        # The planner speaks the trainer's group names (qkv, o, mlp_in, mlp_out).
        assert strategy.st_groups == {g for g, c in zip(PROJECTION_GROUPS, p.layer.choices) if c == "st"}
        compiled = built.lower_train().compile()
        m = compiled.memory_analysis()
        xla = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        cpu = Options(batch=16, seq=2048, attention="chunked", act_bytes=4, check_memory=False)
        predicted = plan_for(run, A100, p.mesh, p.grad_accum, p.remat, p.layer, cpu, 1.0).memory["total"]
        # 20%: XLA:CPU keeps 0.4 GB more than the GPU program around the optimizer's per-weight overflow
        # guard (runtime/step.py; the deviceless H100 compile of llama_1b differs by 0.09 GiB), and the
        # planner prices the GPU's.
        if (linear, str(p.mesh), p.grad_accum, "scan_unroll=true" in p.overrides) in MEMORY_OVER:
            assert predicted > 1.2 * xla, (str(p.mesh), "agrees now: leaves MEMORY_OVER", predicted, xla)
            continue
        assert predicted == pytest.approx(xla, rel=0.20), (str(p.mesh), str(p.layer), predicted, xla)


def small_verify_config(linear: str = "cola"):
    c = base_config()
    c.model.update(
        d_model=512,
        n_heads=8,
        n_kv_heads=8,
        d_ff=1376,
        rank=128,
        n_layers=2,
        vocab_size=1024,
        max_seq_len=64,
        linear=linear,
    )
    return c


def check_verify_rows(rows, st: bool = True, memory: bool = True):
    """Every class and kind agrees (bytes 5%, counts 5% or merged by XLA's all-reduce combiner),
    the grid's permutes are among them, and the peak memory is within 15%."""
    names = [r["traffic"] for r in rows]
    assert not st or "grid fwd+bwd: collective-permute" in names, names
    assert not memory or names[-1] == "peak memory (memory_analysis)", names
    for r in rows:
        assert r["ok"] and r["measured"] > 0, r
        if r["counts"] is not None and not r["combined"]:
            assert r["counts"][0] == r["counts"][1], r


VERIFY_ST = {
    "o_st": ("btp", "cola", ("btp", "st", "btp", "btp")),
    "all_st": ("btp", "cola", ("st",) * 4),
    "megatron_o_st": ("megatron", "cola", ("megatron", "st", "megatron", "megatron")),
    "vanilla_o_down_st": ("vanilla", "cola", ("vanilla", "st", "vanilla", "st")),
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith(("vanilla", "megatron")) else n for n in VERIFY_ST]
)
def test_verify_st_plans_agree_with_the_compiled_step(name):
    """Plans with st groups around btp, megatron (whose factored o-B is stored whole along tensor:
    sliced for the skew, gradient all-reduced) and vanilla on the 2 x 2 fsdp x tensor grid: the
    planner's per-layer bytes and counts by class and kind, the st grid's permutes included,
    against the compiled programs (5%), and its peak memory against the compiled step's (15%)."""
    strategy, linear, choices = VERIFY_ST[name]
    residual, _, attention, act = uniform_plan(strategy)
    rows = compare(
        small_verify_config(linear),
        A100,
        Mesh(1, 2, 2),
        strategy,
        batch=4,
        seq=64,
        layer=Layer(residual, choices, attention, act),
        memory=True,
    )
    check_verify_rows(rows)


GRID4 = {
    "all_st": ("btp", "cola", ("st",) * 4),
    "megatron_o_st": ("megatron", "cola", ("megatron", "st", "megatron", "megatron")),
}


def run_grid4() -> dict[str, str]:
    """The 4 x 4 checks (16 devices; run as a script, see grid4_results)."""
    import traceback

    out = {}
    for name, (strategy, linear, choices) in GRID4.items():
        try:
            residual, _, attention, act = uniform_plan(strategy)
            check_verify_rows(
                compare(
                    small_verify_config(linear),
                    A100,
                    Mesh(1, 4, 4),
                    strategy,
                    batch=4,
                    seq=64,
                    layer=Layer(residual, choices, attention, act),
                    memory=True,
                )
            )
            out[name] = "ok"
        except Exception:  # noqa: BLE001 - report every plan, not just the first failure
            out[name] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def grid4_results() -> dict[str, str]:
    """A 4 x 4 grid needs 16 devices; XLA's device count is fixed at jax import, so the checks run
    once in a subprocess (this file as a script) and report per plan."""
    import json
    import os
    import re
    import subprocess
    import sys

    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=16").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "grid4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=str(ROOT),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS ") :])


@pytest.mark.slow  # ~30 s: 16 devices in a subprocess; the 2x2 grid cases above run by default
@pytest.mark.parametrize("name", list(GRID4))
def test_verify_st_plans_on_a_4x4_grid(grid4_results, name):
    """`plan --verify` on a 4 x 4 grid (16 emulated devices): all-st around btp and an st `o` around
    megatron agree with the compiled step as on the 2 x 2 grid."""
    assert grid4_results[name] == "ok", grid4_results[name]


if __name__ == "__main__":  # the 16-device subprocess of grid4_results
    import json
    import sys

    assert sys.argv[1:] == ["grid4"] and jax.device_count() >= 16, jax.device_count()
    print("RESULTS " + json.dumps(run_grid4()))


def test_whether_the_gpu_program_gets_the_collective_pipeliner_is_read_from_the_flags_and_jaxlib():
    """boost_jax/xla_gpu_flags.pipelined(): the project's flags turn the pipeliner's options on, the
    user's XLA_FLAGS win, and a jaxlib whose XLA retired them (0.11) gets none; the planner's
    cost.pipeliner() needs both the all-gather and the all-reduce one."""
    from boost_jax import xla_gpu_flags as X

    assert X.pipelined({}, jaxlib=(0, 10)) == set(X.PIPELINED)
    assert X.pipelined({}, jaxlib=(0, 11)) == set()
    off = {"XLA_FLAGS": "--xla_gpu_enable_pipelined_all_gather=false"}
    assert X.pipelined(off, jaxlib=(0, 10)) == set(X.PIPELINED) - {"xla_gpu_enable_pipelined_all_gather"}
    assert X.pipelined(
        {"XLA_FLAGS": "--xla_gpu_enable_pipelined_all_gather=false --xla_gpu_enable_pipelined_all_gather=true"},
        jaxlib=(0, 10),
    ) == set(X.PIPELINED)
    assert cost.pipeliner(True) and not cost.pipeliner(False)
    assert X.pipelined({"XLA_FLAGS": "--xla_gpu_enable_pipelined_all_gather=0"}, jaxlib=(0, 10)) == set(X.PIPELINED) - {
        "xla_gpu_enable_pipelined_all_gather"
    }


def test_whether_the_gpu_layer_scan_is_double_buffered_is_read_from_the_flags():
    """boost_jax/xla_gpu_flags.double_buffered(): on with the project's flags, off where the user's
    XLA_FLAGS turn it off (a later repeat wins); the planner prices the double buffer only then."""
    from boost_jax import xla_gpu_flags as X

    assert X.double_buffered({})
    assert not X.double_buffered({"XLA_FLAGS": f"--{X.DOUBLE_BUFFERING}=false"})
    assert X.double_buffered({"XLA_FLAGS": f"--{X.DOUBLE_BUFFERING}=false --{X.DOUBLE_BUFFERING}"})
    assert cost.double_buffering(True) and not cost.double_buffering(False)


def test_the_pipeliner_term_prices_unpipelined_fsdp_bottleneck_plans_only():
    """cost.PIPELINED_SIGMA: PIPELINED_SIGMA arrays of each σ(A·x) output per layer on unpipelined FSDP
    GPU plans without remat; nothing for a dense kind, a pipelined plan, context parallelism, data
    parallelism alone, remat,
    the float32 CPU program, or a program without the pipeliner."""
    cluster = load_cluster(str(ROOT / "configs" / "clusters" / "h100_8x.py"))
    layer = Layer("R", ("none",) * len(PROJECTION_GROUPS), "R", "R")

    def part(linear, mesh, remat="none", act_bytes=2, pipelined=True, **kw):
        cfg = sized_config("1b", linear)
        return plan_for(
            cfg,
            cluster,
            mesh,
            1,
            remat,
            layer,
            Options(batch=64, seq=256, check_memory=False, act_bytes=act_bytes, pipelined=pipelined),
            **kw,
        ).memory["pipeliner"]

    cfg = sized_config("1b", "cola")
    r, layers = cfg.model.rank, cfg.model.n_layers
    tokens = 64 // 8 * 256  # this device's rows x seq
    a_outputs = 7  # q, k, v, o, gate, up, down
    assert part("cola", Mesh(1, 8, 1)) == pytest.approx(cost.PIPELINED_SIGMA * layers * a_outputs * tokens * r * 2)
    assert part("cola", Mesh(1, 8, 1), pipelined=False) == 0
    assert part("dense", Mesh(1, 8, 1)) == 0
    assert part("cola", Mesh(8, 1, 1)) == 0
    assert part("cola", Mesh(1, 8, 1), remat="lowrank") == 0
    assert part("cola", Mesh(1, 8, 1), act_bytes=4) == 0
    assert part("cola", Mesh(1, 4, 1, pipeline=2)) == 0
    assert part("cola", Mesh(1, 4, 1, context=2)) == 0


def test_xla_packing_overhead_by_the_kinds_of_parallelism_a_step_mixes():
    """cost.GPU_BUFFER_OVERHEAD: a GPU step is priced at what it keeps, but where a pipeline meets another
    kind of parallelism (data x fsdp, tensor or context), 1F1B without remat aside:
    GPU_BUFFER_OVERHEAD[1] times its temporaries (what is not a parameter or an Adam moment); the
    float32 CPU program BUFFER_OVERHEAD whatever its mesh."""
    cluster = load_cluster(str(ROOT / "configs" / "clusters" / "h100_8x.py"))
    cfg = sized_config("1b", "dense")
    megatron = Layer(*uniform_plan("megatron", False))
    replicated = Layer("R", ("none",) * len(PROJECTION_GROUPS), "R", "R")

    def factor(mesh, layer, act_bytes=2, remat="none", schedule="gpipe"):
        opts = Options(batch=64, seq=256, check_memory=False, act_bytes=act_bytes)
        m = plan_for(cfg, cluster, mesh, 1, remat, layer, opts, 1.0, 4, schedule).memory
        kept = sum(v for k, v in m.items() if k not in ("total", "allocator"))
        arguments = m["states"] * (cost.ADAM_STATE_BYTES - cost.STATE_BYTES) / cost.ADAM_STATE_BYTES
        assert m["total"] == pytest.approx(kept + m["allocator"])
        return 1 + m["allocator"] / (kept - arguments)

    one_kind = (
        (Mesh(1, 8, 1), replicated),
        (Mesh(8, 1, 1), replicated),
        (Mesh(2, 4, 1), replicated),
        (Mesh(1, 1, 8), megatron),
        (Mesh(1, 1, 1, pipeline=8), replicated),
        (Mesh(1, 4, 2), megatron),
    )
    for mesh, layer in one_kind:
        assert factor(mesh, layer) == pytest.approx(cost.GPU_BUFFER_OVERHEAD[0]), mesh
    assert factor(Mesh(1, 1, 1, pipeline=8), replicated, remat="full") == pytest.approx(cost.GPU_BUFFER_OVERHEAD[0])
    pipelined = ((Mesh(1, 4, 1, pipeline=2), replicated), (Mesh(1, 1, 2, pipeline=2), megatron))
    for mesh, layer in pipelined:
        assert factor(mesh, layer) == pytest.approx(cost.GPU_BUFFER_OVERHEAD[1]), mesh
        assert factor(mesh, layer, remat="full", schedule="1f1b") == pytest.approx(cost.GPU_BUFFER_OVERHEAD[1]), mesh
        assert factor(mesh, layer, schedule="1f1b") == pytest.approx(cost.GPU_BUFFER_OVERHEAD[0]), mesh
    for mesh, layer in one_kind[:1] + ((Mesh(1, 4, 2), megatron),):
        assert factor(mesh, layer, act_bytes=4) == pytest.approx(cost.BUFFER_OVERHEAD), mesh


def test_the_gpu_loss_and_the_scan_double_buffer_terms():
    """The GPU program's loss holds one float32 logits array at a time (cost.GPU_LOGIT_BUFFERS, the
    float32 program three) and, in bf16, its cotangent's bf16 cast (cost.GPU_LOGIT_CAST), and 6 bytes
    per table element (float32 gradient, bf16 gathered cast; the
    float32 program 8 under FSDP); the double-buffered layer scan keeps one more [L, T, ff/t] array
    (cost.SCAN_DOUBLE_BUFFER) on unpipelined GPU plans without remat that get the flag, nothing elsewhere."""
    rows, seq, vocab = 3, 256, 1000
    assert cost.loss_bytes(rows, seq, 0, vocab, gpu=True) == rows * seq * vocab * 4
    assert cost.loss_bytes(rows, seq, 0, vocab) == 3 * rows * seq * vocab * 4
    assert cost.loss_bytes(rows, seq, 64, vocab, gpu=True) == rows * 64 * vocab * 4
    # a bf16 step's head backward reads the logits' cotangent cast to bf16 beside the float32 one
    assert cost.loss_bytes(rows, seq, 64, vocab, gpu=True, act_bytes=2) == rows * 64 * vocab * (4 + 2)
    assert (cost.table_bytes(8, 2), cost.table_bytes(1, 2), cost.table_bytes(8, 4), cost.table_bytes(1, 4)) == (
        6,
        6,
        8,
        4,
    )

    cluster = load_cluster(str(ROOT / "configs" / "clusters" / "h100_8x.py"))
    cfg = sized_config("1b", "dense")
    layers, ff = cfg.model.n_layers, cfg.model.d_ff

    def part(
        mesh,
        layer=Layer("R", ("none",) * len(PROJECTION_GROUPS), "R", "R"),
        remat="none",
        act_bytes=2,
        double_buffered=True,
    ):
        return plan_for(
            cfg,
            cluster,
            mesh,
            1,
            remat,
            layer,
            Options(batch=64, seq=256, check_memory=False, act_bytes=act_bytes, double_buffered=double_buffered),
        ).memory["double_buffer"]

    assert part(Mesh(1, 8, 1)) == pytest.approx(layers * (64 // 8 * 256) * ff * 2)
    megatron = Layer(*uniform_plan("megatron", False))
    assert part(Mesh(1, 4, 2), megatron) == pytest.approx(layers * (64 // 4 * 256) * ff / 2 * 2)
    assert part(Mesh(1, 8, 1), remat="full") == 0
    assert part(Mesh(1, 8, 1), act_bytes=4) == 0
    assert part(Mesh(1, 4, 1, pipeline=2)) == 0
    assert part(Mesh(1, 8, 1), double_buffered=False) == 0
