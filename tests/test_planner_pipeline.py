"""The planner's pipelined plans (issue 21): GPipe and circular schedules, remat.pipeline=stage, their
search space and flags, and `--verify` of pipelined plans against the compiled, scanned train step
(collectives by class and kind, peak memory), or its one-line refusal."""
import math

import pytest

from boost_jax.config import base_config, sized_config
from boost_jax.planner import Layer, Mesh, Options, cost, load_cluster, plan_for, search
from boost_jax.planner import partitions as P
from boost_jax.planner.search import check_pipeline, pipeline_variants
from boost_jax.planner.verify import compare_pipeline, pipeline_refusal
from test_planner import A100, H100, ROOT, with_overrides

BTP = Layer(*P.uniform_plan("btp"))


def small_config():
    c = base_config()
    c.model.update(d_model=256, n_heads=4, n_kv_heads=4, d_ff=688, rank=64, vocab_size=512, max_seq_len=64)
    return c


def test_ticks_bubble_and_what_a_tick_runs():
    """V M + S - 1 ticks of L/(S V) layers: layer passes and hand-overs follow the formula, the bubble
    is (S-1)/(V M + S-1), and a circular plan moves its stage weights once per pass."""
    cfg, opts = sized_config("13b", "cola"), Options(batch=512, seq=256, check_memory=False)
    for schedule, v in (("gpipe", 1), ("circular", 2), ("circular", 5)):
        p = plan_for(cfg, H100, Mesh(1, 1, 4, 4), 4, "full", BTP, opts, 1.0, 8, schedule, v)
        ticks = v * 8 + 3
        assert p.bubble == pytest.approx(3 / ticks) == cost.bubble_fraction(4, 8, v)
        permutes = [t for c, t in p.step_colls if c.axis == "pipeline" and c.kind == "collective-permute"
                    and c.elements == p.pipeline_colls[0].elements]
        assert permutes == [ticks, ticks]  # one hand-over each way per tick
        tensor = {t for c, t in p.step_colls if c.axis == "tensor"}
        assert tensor == {1, ticks * 40 // (4 * v)}  # the head's once; the layers': ticks x L/(S V)
        moves = [c for c, _ in p.step_colls if c.axis == "pipeline_weights"]
        assert (len(moves) == 2) == (schedule == "circular")  # once per pass each way
        assert all(c.kind == ("all-to-all" if v == 2 else "all-gather") for c in moves)  # S 4: V 2 divides it, 5 not


def test_stage_remat_keeps_one_input_per_tick_and_pays_a_forward():
    """remat.pipeline=stage: kept activations are one stage input per tick (they no longer grow with the
    layers per stage), the step re-runs every layer's forward (time and forward collectives), and the
    flags say so."""
    cfg = sized_config("13b", "cola")
    opts = Options(batch=512, seq=256, check_memory=False)
    base, staged = (plan_for(cfg, H100, Mesh(2, 1, 4, 2), 2, "none", BTP, opts, 1.0, 8, stage_remat=r)
                    for r in ("none", "stage"))
    ticks, one = 8 + 1, 512 // 2 // 2 // 8 * 256 * 5120 / 4  # rows per micro-batch x seq x d/t
    assert staged.memory["activations"] == pytest.approx(ticks * one * 2)
    assert base.memory["activations"] > 10 * staged.memory["activations"]
    assert staged.step_s > base.step_s
    fwd = sum(c.elements for c in base.layer_colls if c.axis == "tensor" and c.phase == "fwd")
    extra = sum(t * c.elements for c, t in staged.step_colls) - sum(t * c.elements for c, t in base.step_colls)
    assert extra == pytest.approx(ticks * 20 * fwd)
    assert staged.overrides.endswith("--config.remat.pipeline=stage") and "remat.pipeline" not in base.overrides


def test_search_covers_schedules_repeats_and_stage_remat():
    assert pipeline_variants(40, 1, 1, Options(batch=1, seq=1)) == [("gpipe", 1, "none")]
    got = pipeline_variants(40, 4, 8, Options(batch=1, seq=1))
    assert got == [("gpipe", 1, "none"), ("gpipe", 1, "stage")] + [
        ("circular", v, r) for v in (2, 5, 10) for r in ("none", "stage")]
    assert all(s == "gpipe" for s, _, _ in pipeline_variants(40, 4, 2, Options(batch=1, seq=1)))  # M < S
    only = Options(batch=1, seq=1, schedules=("circular",), repeats=5, stage_remat=("stage",))
    assert pipeline_variants(40, 4, 8, only) == [("circular", 5, "stage")]
    res = search(sized_config("13b", "cola"), H100, 32, Options(batch=512, seq=256, top=200, pipeline=(4,)),
                 flops_per_token=1.0)
    kinds = {(p.schedule, p.stage_remat) for p in res.plans}
    assert {("gpipe", "none"), ("circular", "none")} <= {k for k in kinds} and res.best_runnable is not None
    circular = next(p for p in res.plans if p.schedule == "circular" and p.runnable == "yes")
    assert (f"--config.parallel.pipeline_schedule=circular --config.parallel.pipeline_repeats={circular.repeats} "
            in circular.overrides)
    for msg, args in (("divide", (40, 4, 8, "circular", 3, "none")), ("one micro-batch per stage",
                      (40, 4, 2, "circular", 2, "none")), ("need pipeline > 1", (40, 1, 1, "gpipe", 1, "stage"))):
        with pytest.raises(ValueError, match=msg):
            check_pipeline(*args)


def test_pipelined_flags_build_the_trainer_schedule():
    """A circular + stage-remat plan's --config flags validate and build the schedule they name."""
    from boost_jax.runtime.build import build

    cfg = small_config()
    cfg.model.n_layers = 8
    cfg.data.source = "embedded"
    p = plan_for(cfg, A100, Mesh(2, 1, 2, 2), 1, "lowrank", BTP, Options(batch=8, seq=32, check_memory=False), 1.0,
                 4, "circular", 2, "stage")
    run = with_overrides(cfg, p.overrides)
    assert (run.parallel.pipeline_schedule, run.parallel.pipeline_repeats, run.remat.pipeline) == (
        "circular", 2, "stage")
    built = build(run)
    assert (built.strategy.pipeline_schedule, built.strategy.pipeline_repeats) == ("circular", 2)


def check_rows(rows, memory=True):
    names = [r["traffic"] for r in rows]
    assert "pipeline (whole step): collective-permute" in names and "pipeline (whole step): all-reduce" in names
    assert not memory or names[-1] == "peak memory (memory_analysis)", names
    for r in rows:
        assert r["ok"] and r["measured"] > 0, r
        if r["counts"] is not None and not r["combined"]:
            assert math.isclose(*r["counts"], rel_tol=0.05), r


# (mesh p, d, f, t; remat policy; micro-batches; remat.pipeline). The stage-remat none case on both
# meshes set cost.STAGE_COPY; the others are held out.
GPIPE = {"data_none": ((2, 2, 1, 2), "none", 4, "none"), "fsdp_lowrank_stage": ((2, 1, 2, 2), "lowrank", 4, "stage"),
         "data_full_stage": ((2, 2, 1, 2), "full", 4, "stage"),
         "fsdp_none_stage": ((2, 1, 2, 2), "none", 4, "stage")}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith("fsdp_none") else n
                                  for n in GPIPE])
def test_verify_gpipe_plans_agree_with_the_compiled_step(name):
    """`plan --verify` on a GPipe plan: the whole scanned train step's collectives by class and kind
    (the per-tick hand-overs and stage-0 input reductions, the ends, tensor traffic with the stage
    remat's second forward, once-per-pass data/fsdp) within 5%, the peak memory within 15%."""
    (p, d, f, t), remat, micro, stage = GPIPE[name]
    rows = compare_pipeline(small_config(), A100, Mesh(d, f, t, p), "btp", remat=remat, microbatches=micro, seq=32,
                            stage_remat=stage, layers_per_chunk=2)
    check_rows(rows)


# (mesh p, d, f, t; remat policy; V; remat.pipeline). CIRCULAR_COPIES was set on p2 x d2 x t2 and
# p2 x d2 x f2 (V 2, remat none); these are held out.
CIRCULAR = {"fsdp_none_v2": ((2, 1, 2, 2), "none", 2, "none"), "data_none_v3": ((2, 2, 1, 2), "none", 3, "none"),
            "fsdp_lowrank_stage_v2": ((2, 1, 2, 2), "lowrank", 2, "stage")}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith("data") else n
                                  for n in CIRCULAR])
def test_verify_circular_plans_agree_with_the_compiled_step(name):
    """`plan --verify` on a circular plan: V M + S - 1 ticks of hand-overs and stage-0 reductions, the
    weight reorder in the stored split (V 2 on 2 stages: one all-to-all per weight each way; V 3: the
    stack gathered over pipeline each way), the copies gathered over tensor once per pass (the arrays
    split along their last dim), tensor traffic, once-per-pass data/fsdp within 5%, peak memory within
    15%."""
    (p, d, f, t), remat, v, stage = CIRCULAR[name]
    rows = compare_pipeline(small_config(), A100, Mesh(d, f, t, p), "btp", remat=remat, microbatches=4, seq=32,
                            schedule="circular", repeats=v, stage_remat=stage)
    check_rows(rows)
    by = {r["traffic"]: r for r in rows}
    assert by["pipeline (whole step): collective-permute"]["counts"] == (2 * (v * 4 + 1),) * 2
    assert by["pipeline weights (whole step)"]["measured"] > 0
    assert by["tensor (whole step): all-gather"]["counts"] == (1, 1)  # the head's; the copies keep the tensor split


def test_circular_reorder_kinds():
    """The reorder is an all-to-all each way when V and S divide one another, else a gather of the
    stack each way."""
    cfg, opts = small_config(), Options(batch=16, seq=32, check_memory=False)
    cfg.model.n_layers = 12
    kinds = {}
    for mesh, v in ((Mesh(1, 1, 2, 2), 2), (Mesh(1, 1, 2, 2), 3), (Mesh(1, 1, 2, 4), 3), (Mesh(1, 1, 2, 2), 1)):
        plan = plan_for(cfg, A100, mesh, 1, "none", BTP, opts, 1.0, 4, "circular" if v > 1 else "gpipe", v)
        kinds[(mesh.pipeline, v)] = plan
    moves = lambda p, axis: [c for c, _ in p.step_colls if c.axis == axis]  # noqa: E731
    assert {c.kind for c in moves(kinds[(2, 2)], "pipeline_weights")} == {"all-to-all"}
    gathered = moves(kinds[(2, 3)], "pipeline_weights")
    assert {c.kind for c in gathered} == {"all-gather"}
    a2a = moves(kinds[(2, 2)], "pipeline_weights")[0].elements  # 6 layers per stage either way
    assert gathered[0].elements == pytest.approx(2 * a2a)
    assert {c.kind for c in moves(kinds[(4, 3)], "pipeline_weights")} == {"all-gather"}  # 4 % 3, 3 % 4


def test_verify_refuses_what_it_does_not_compare():
    cfg, opts = small_config(), Options(batch=8, seq=32, check_memory=False)
    cfg.model.n_layers = 4
    circ = plan_for(cfg, A100, Mesh(1, 2, 2, 2), 1, "none", BTP, opts, 1.0, 2, "circular", 2)
    assert pipeline_refusal(circ) == ""  # compared (test_verify_circular_plans_agree_with_the_compiled_step)
    st = plan_for(cfg, A100, Mesh(1, 2, 2, 2), 1, "none", Layer("H", ("btp", "st", "btp", "btp"), "H", "H"), opts, 1.0)
    assert "st" in pipeline_refusal(st)
    meg = plan_for(cfg, A100, Mesh(2, 1, 2, 2), 1, "none", Layer(*P.uniform_plan("megatron")), opts, 1.0)
    assert "residual" in pipeline_refusal(meg)
    assert pipeline_refusal(plan_for(cfg, A100, Mesh(2, 1, 2, 2), 1, "none", BTP, opts, 1.0)) == ""
