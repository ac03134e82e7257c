"""The parallelism planner (boost_jax/planner): α-β formulas, memory rejection, the search space, the
7B validation against BOOST's reported times, search speed, pipeline plans, and its collectives
against the HLO."""
import importlib.util
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from jax.sharding import Mesh as JaxMesh

from boost_jax.config import base_config, sized_config
from boost_jax.planner import Layer, Mesh, Options, cost, load_cluster, plan_for, search
from boost_jax.planner import partitions as P
from boost_jax.planner.search import meshes, microbatch_counts, stage_counts
from boost_jax.planner.verify import compare, compare_pipeline

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
    ar = P.Coll("all-reduce", 1e9, 8, 1, "fwd")  # 2 GB of bf16 over 8 A100s: crosses Slingshot
    assert cost.coll_seconds(ar, A100, 2) == pytest.approx(2 * 7 / 8 * 2e9 / 20e9 + 14 * 20e-6)


def test_skinny_gemms_are_penalised():
    square = cost.gemm_efficiency(4096, 4096, 4096, A100)
    assert square == pytest.approx(0.85 * (4096 / (4096 + 96)) ** 3)
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
        (d, f, 12 // (d * f)) for d in range(1, 13) for f in range(1, 13) if 12 % (d * f) == 0)
    assert sorted((m.pipeline, m.data * m.fsdp * m.tensor) for m in meshes(12, (1, 3))) == sorted(
        [(1, 12)] * 18 + [(3, 4)] * 6)
    assert stage_counts(64, 40, Options(batch=1, seq=1)) == [1, 2, 4, 8]  # divide devices and layers
    assert stage_counts(64, 40, Options(batch=1, seq=1, pipeline=(2, 3, 16))) == [2]
    assert microbatch_counts(1, 64, Options(batch=1, seq=1)) == [1]
    assert microbatch_counts(4, 24, Options(batch=1, seq=1)) == [4, 8]  # 16 does not split 24 rows
    res = search(sized_config("7b", "cola"), H100, 64, Options(batch=512, seq=256, top=10), flops_per_token=1.0)
    assert len(res.plans) == 10
    assert all(p.mesh.devices == 64 for p in res.plans)
    assert res.plans == sorted(res.plans, key=lambda p: p.step_s)
    assert res.best_runnable is not None and res.best_runnable.runnable == "yes"
    assert "--config.parallel.strategy=" in res.best_runnable.overrides
    assert any(p.runnable.startswith("no:") for p in res.plans)  # mixed / st plans are flagged


def test_search_takes_under_10s_for_64_devices():
    res = search(sized_config("7b", "cola"), H100, 64, Options(batch=512, seq=4096), flops_per_token=1.0)
    assert res.plans and res.seconds < 10.0
    # With pipeline stages and GPipe micro-batch counts in the space (13B: 40 layers, S in 1, 2, 4, 8).
    res = search(sized_config("13b", "cola"), H100, 64, Options(batch=512, seq=256, top=10), flops_per_token=1.0)
    assert res.seconds < 10.0 and res.considered > 10_000
    res = search(sized_config("13b", "cola"), H100, 64, Options(batch=512, seq=256, top=10, pipeline=(2, 4)),
                 flops_per_token=1.0)
    piped = [p for p in res.plans if p.mesh.pipeline > 1]
    assert piped and all(p.mesh.devices == 64 and 40 % p.mesh.pipeline == 0 for p in piped)
    runnable = next(p for p in piped if p.runnable == "yes")
    assert (f"--config.parallel.pipeline={runnable.mesh.pipeline} "
            f"--config.parallel.microbatches={runnable.microbatches} ") in runnable.overrides
    assert (512 // runnable.grad_accum // (runnable.mesh.data * runnable.mesh.fsdp)) % runnable.microbatches == 0


@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_step_time_grows_with_the_bubble(stages):
    """Fewer GPipe micro-batches (same S, same batch): a bigger bubble, (S-1)/(M+S-1), and a slower step
    that tracks the ticks per micro-batch, (M+S-1)/M (bigger micro-batches run slightly better GEMMs)."""
    cfg, btp = sized_config("13b", "cola"), Layer(*P.uniform_plan("btp"))
    plans = [plan_for(cfg, H100, Mesh(2, 1, 4, stages), 1, "full", btp, Options(batch=512, seq=256), 1.0, m)
             for m in (4 * stages, 2 * stages, stages)]
    assert [p.bubble for p in plans] == [(stages - 1) / (m + stages - 1) for m in (4 * stages, 2 * stages, stages)]
    assert plans[0].step_s < plans[1].step_s < plans[2].step_s
    ticks = (2 * stages - 1) / stages / ((5 * stages - 1) / (4 * stages))
    assert 0.8 * ticks < plans[2].step_s / plans[0].step_s < ticks
    assert all(p.shift_s > 0 and p.pipeline_colls[0].size == stages for p in plans)
    assert all(p.runnable == "yes" and "--config.parallel.pipeline=" in p.overrides for p in plans)


def test_pipeline_splits_a_model_too_big_for_one_gpu():
    """cola_13b's fp32 states (16 B/param) overflow one 80 GB H100; with 2 stages each GPU holds half the
    layers and the plan fits."""
    cfg, one = sized_config("13b", "cola"), Layer("R", ("none",) * 4, "R", "R")
    opts = Options(batch=8, seq=256, check_memory=False)
    flat = plan_for(cfg, H100, Mesh(1, 1, 1), 1, "full", one, opts, 1.0)
    piped = plan_for(cfg, H100, Mesh(1, 1, 1, 2), 1, "full", one, opts, 1.0)
    assert flat.memory["total"] > H100.usable_hbm >= piped.memory["total"]
    rest = (2 * 32000 * 5120 + 5120) * cost.ADAM_STATE_BYTES  # embedding, head, final norm: on every stage
    assert piped.memory["states"] - rest == pytest.approx((flat.memory["states"] - rest) / 2)
    # The search on 2 GPUs: the fitting plans split the parameters (pipeline, fsdp or tensor); pure
    # data parallelism (a whole replica per GPU) is rejected; pipeline plans are among those kept.
    res = search(cfg, H100, 2, Options(batch=8, seq=256, top=50), flops_per_token=1.0)
    assert res.plans and res.rejected_memory > 0
    assert all(p.mesh.data < 2 for p in res.plans)
    assert any(p.mesh.pipeline == 2 and p.runnable == "yes" for p in res.plans)


def test_7b_validation_matches_boost_ordering_and_ratios():
    spec = importlib.util.spec_from_file_location("planner_validation", ROOT / "benchmarks/planner_validation.py")
    validation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(validation)
    plans = validation.predict()
    t = {k: p.step_s for k, p in plans.items()}
    assert t["btp"] < t["megatron"] < t["vanilla"]  # full-rank Megatron slower than BTP, vanilla slowest
    assert validation.check(plans) == []  # each ratio to BTP within 30% of the reported one


def test_btp_forward_traffic_is_7r_per_token():
    cfg = sized_config("7b", "cola")
    plan = plan_for(cfg, A100, Mesh(1, 1, 4), 1, "none", Layer(*P.uniform_plan("btp")),
                    Options(batch=4, seq=4096, check_memory=False), flops_per_token=1.0)
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
        o, vjp = jax.vjp(lambda a, v: st.st_matmul(st.skew_sharded(a, **kw),
                                                   st.skew_weight_sharded(v, ("row", "col"), **grid), **kw), i, w)
        return (o, *vjp(g))

    act, weight = NamedSharding(mesh, PartitionSpec("row", None, "col")), NamedSharding(mesh, PartitionSpec("row", "col"))
    args = [jax.ShapeDtypeStruct((b, t, k), jnp.float32, sharding=act),
            jax.ShapeDtypeStruct((k, n_out), jnp.float32, sharding=weight),
            jax.ShapeDtypeStruct((b, t, n_out), jnp.float32, sharding=act)]
    measured = parse_collectives(jax.jit(f).lower(*args).compile().as_text(), mesh)
    predicted = P.StMatmul(b * t / 2, k, n_out, 2, "W").colls()  # m: one device's tokens
    assert {c.kind for c in measured} == {"collective-permute"}
    assert len(measured) == len(predicted)
    assert sorted(c.elements for c in measured) == sorted(c.elements for c in predicted)


def test_verify_agrees_with_comm_report():
    """Predicted per-layer collective bytes against the HLO of the real train step's programs."""
    c = base_config()
    c.model.update(d_model=512, n_heads=8, n_kv_heads=8, d_ff=1376, rank=128, n_layers=2, vocab_size=1024,
                   max_seq_len=64)
    rows = compare(c, A100, Mesh(1, 2, 2), "btp", batch=2, seq=64)
    assert [r["traffic"] for r in rows][:3] == ["tensor fwd", "tensor bwd", "data/fsdp fwd+bwd"]
    for r in rows:
        assert r["ok"], r
        assert r["measured"] > 0 and math.isclose(r["predicted"], r["measured"], rel_tol=0.10)


@pytest.mark.parametrize("mesh, remat, micro", [(Mesh(1, 2, 2, pipeline=2), "lowrank", 2),
                                                 (Mesh(2, 1, 2, pipeline=2), "none", 4)])
def test_verify_pipeline_agrees_with_the_compiled_step(mesh, remat, micro):
    """A pipelined plan's whole-step traffic (hand-overs, the pipeline's ends, per-tick gradient
    reductions, once-gathered FSDP weights, remat re-gathers) against the compiled GPipe step."""
    c = base_config()
    c.model.update(d_model=256, n_heads=4, n_kv_heads=4, d_ff=688, rank=64, vocab_size=512, max_seq_len=64)
    rows = compare_pipeline(c, A100, mesh, "btp", remat=remat, microbatches=micro, seq=32)
    assert [r["traffic"] for r in rows] == [f"{k} (whole step)" for k in ("pipeline", "tensor", "data/fsdp")]
    for r in rows:
        assert r["measured"] > 0 and math.isclose(r["predicted"], r["measured"], rel_tol=0.02), r


@pytest.mark.parametrize("policy, xla_gib", [("none", 299.10), ("full", 25.46), ("lowrank", 30.81)])
def test_activation_memory_tracks_xla(policy, xla_gib):
    """Against XLA's memory analysis of cola_1b, seq 2048, batch 8 on one device (remat_memory.md)."""
    cfg = sized_config("1b", "cola")
    plan = plan_for(cfg, A100, Mesh(1, 1, 1), 1, policy, Layer("R", ("none",) * 4, "R", "R"),
                    Options(batch=8, seq=2048, check_memory=False), flops_per_token=1.0)
    m = plan.memory
    assert (m["activations"] + m["working"] + m["logits"]) / 2**30 == pytest.approx(xla_gib, rel=0.15)


def with_overrides(cfg, flags: str):
    """cfg with the planner's `--config.key=value` flags applied (as the trainer's command line would)."""
    from boost_jax.config import validate
    cfg = cfg.copy_and_resolve_references()
    for flag in flags.split():
        key, _, value = flag.removeprefix("--config.").partition("=")
        *parents, leaf = key.split(".")
        node = cfg
        for name in parents:
            node = node[name]
        old = node[leaf]
        node[leaf] = value == "true" if isinstance(old, bool) else type(old)(value)
    return validate(cfg)


@pytest.mark.parametrize("linear", ["cola", "dense"])
def test_runnable_top_plans_compile(linear):
    """Every top-5 plan marked runnable, and the best runnable plan with st groups on each strategy
    (mixed: btp/st/btp/btp for CoLA, megatron and megatron-SP around an st `o` for dense), builds
    the mesh and strategy it names and compiles as the trainer's step on 8 emulated devices (7B
    widths, 2 layers, abstract shapes)."""
    from boost_jax.optim import make_optimizer
    from boost_jax.parallel.mesh import make_mesh
    from boost_jax.parallel.rules import use_rules
    from boost_jax.parallel.strategies import get_strategy
    from boost_jax.state import state_spec
    from boost_jax.step import jit_train_step

    cfg = sized_config("7b", linear)
    cfg.model.n_layers = 2
    cfg.data.source = "embedded"
    res = search(cfg, A100, 8, Options(batch=16, seq=2048, top=30), flops_per_token=1.0)
    plans = [p for p in res.plans[:5] if p.runnable == "yes"]
    with_st = {}
    for p in res.plans:
        if p.runnable == "yes" and "st" in p.layer.choices:
            with_st.setdefault((p.strategy, p.sequence_parallel), p)
    assert with_st, [str(p.layer) for p in res.plans]
    plans += [p for p in with_st.values() if p not in plans]
    for p in plans:
        run = with_overrides(cfg, p.overrides)
        tx, schedule = make_optimizer(run.train)
        mesh, strategy = make_mesh(run), get_strategy(run.parallel)
        assert (mesh.shape["pipeline"], mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["tensor"]) == (
            p.mesh.pipeline, p.mesh.data, p.mesh.fsdp, p.mesh.tensor)
        trainer_groups = {"qkv": "qkv", "o": "o", "gate_up": "mlp_in", "down": "mlp_out"}
        assert strategy.st_groups == {trainer_groups[g] for g, c in zip(P.GROUPS, p.layer.choices) if c == "st"}
        with use_rules(mesh, strategy):
            spec = state_spec(run, tx, mesh, strategy)
            step, batch_sharding = jit_train_step(spec, tx, schedule, mesh)
            micro = run.train.global_batch // run.train.grad_accum
            batch = jax.ShapeDtypeStruct((run.train.grad_accum, micro, run.train.seq_len + 1), jnp.int32,
                                         sharding=batch_sharding)
            step.lower(spec.abstract, batch).compile()


@pytest.mark.parametrize("choices", [("btp", "st", "btp", "btp"), ("st", "st", "st", "st")], ids=["o_st", "all_st"])
def test_verify_st_plans_agree_with_the_compiled_step(choices):
    """A mixed and an all-st plan (around btp, on the 2 x 2 fsdp x tensor grid): the planner's per-layer
    bytes by class, the st grid's permutes included, against the compiled programs within 5%."""
    c = base_config()
    c.model.update(d_model=512, n_heads=8, n_kv_heads=8, d_ff=1376, rank=128, n_layers=2, vocab_size=1024,
                   max_seq_len=64)
    rows = compare(c, A100, Mesh(1, 2, 2), "btp", batch=2, seq=64, layer=Layer("H", choices, "H", "H"))
    assert "st grid fwd+bwd" in [r["traffic"] for r in rows]
    for r in rows:
        assert r["measured"] > 0 and math.isclose(r["predicted"], r["measured"], rel_tol=0.05), r
