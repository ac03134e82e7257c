"""Every strategy x linear kind x mesh computes the single-device loss and gradients (float32)."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax import train
from boost_jax.data import build_loaders
from boost_jax.parallel.mesh import BATCH_AXES, ONE_DEVICE
from boost_jax.parallel.pipeline import arithmetic
from boost_jax.runtime.build import build
from boost_jax.runtime.state import trainable, with_frozen
from boost_jax.runtime.step import next_token_loss

# (1, 2, 4) and (8, 1, 1) repeat what (2, 2, 2) and (2, 1, 4) cover (an fsdp split; data parallelism
# alone): slow. Of the other three meshes the default run takes one per strategy x kind, a Latin square
# (mesh index = strategy index + kind index, mod 3): every strategy meets every kind, every kind every
# mesh and every strategy every mesh; the rest of the matrix runs with -m slow.
MESHES = [(1, 1, 8), (2, 1, 4), (1, 2, 4), (2, 2, 2), (8, 1, 1)]
DEFAULT_MESHES = [(1, 1, 8), (2, 1, 4), (2, 2, 2)]
STRATEGIES = ["btp", "vanilla", "megatron"]
LINEARS = ["dense", "lowrank", "cola", "tt", "sltrain"]
STRATEGY_CASES = [
    pytest.param(
        strategy,
        linear,
        mesh,
        id=f"{strategy}-{linear}-{'x'.join(map(str, mesh))}",
        marks=()
        if mesh in DEFAULT_MESHES and DEFAULT_MESHES.index(mesh) == (i + j) % len(DEFAULT_MESHES)
        else pytest.mark.slow,
    )
    for i, strategy in enumerate(STRATEGIES)
    for j, linear in enumerate(LINEARS)
    for mesh in MESHES
]
# Shapes of the kinds that have their own fields: 2 + 2 TT cores (modes 8 x 8 for d, 16 x 8 for the MLP,
# so tensor sizes up to 8 split the outer modes) with SiLU at the bottleneck; 4 x 4 sparse blocks.
KIND_FIELDS = {
    "tt": {"model.tt_cores": 4, "model.tt_inner_rank": 4, "model.tt_activation": "silu"},
    "sltrain": {"model.sparse_block": 4, "model.sparse_density": 0.1},
}


def par_config(make_config, strategy, linear, mesh, **kw):
    data, fsdp, tensor = mesh
    pipeline = kw.get("parallel.pipeline", 1)
    overrides = {
        "model.d_model": 64,
        "model.n_heads": 8,
        "model.n_kv_heads": 8,
        "model.d_ff": 128,
        "model.rank": 16,
        "model.linear": linear,
        "parallel.strategy": strategy,
        "parallel.data": data,
        "parallel.fsdp": fsdp,
        "parallel.tensor": tensor,
        "parallel.num_devices": pipeline * data * fsdp * tensor,
    }
    overrides.update(KIND_FIELDS.get(linear, {}))
    overrides.update(kw)
    return make_config(**overrides)


def loss_and_grads(cfg, params_host, tokens, collectives=False):
    """(loss, grads) of one micro-batch under cfg's mesh and strategy; with `collectives`, also the
    compiled program's collectives (hlo_comm.Collective list)."""
    built = build(cfg)
    spec, mesh = built.spec, built.mesh
    params = jax.device_put(params_host, spec.shardings["params"])
    batch = jax.device_put(tokens, NamedSharding(mesh, P(BATCH_AXES)))
    fn = jax.jit(built.bind(jax.value_and_grad(lambda t, p, x: next_token_loss(spec.graphdef, with_frozen(t, p), x))))
    args = (trainable(params), params, batch)
    loss, grads = fn(*args)
    if collectives:
        from boost_jax.tools.hlo_comm import parse_collectives

        colls = parse_collectives(fn.lower(*args).compile().as_text(), mesh)
        return float(loss), jax.device_get(grads), colls
    return float(loss), jax.device_get(grads)


_REFERENCES: dict = {}


def reference(cfg):
    """Params, tokens, loss and grads on one device; cached by everything but the parallel section
    (on one device every strategy's table shards nothing, so they share one reference)."""
    key = (cfg.model.to_json(), cfg.train.to_json(), cfg.data.to_json(), cfg.kernels.rmsnorm, cfg.seed)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(cfg)
    return _REFERENCES[key]


def _reference(cfg):
    single = cfg.copy_and_resolve_references()
    single.parallel.update(ONE_DEVICE, num_devices=1)
    # the key leaves out the parallel section: the reference reduces nothing in a narrower dtype either
    single.parallel.grad_reduce_dtype = "float32"
    single.remat.pipeline = "none"
    params = perturb_zero_factors(jax.device_get(build(single).init_state()["params"]))
    tokens = build_loaders(single)[0].batch(0)
    return params, tokens, loss_and_grads(single, params, tokens)


def perturb_zero_factors(params):
    """Fresh random values for factors initialised to zero (sltrain's B), so every gradient path is
    exercised: with B = 0 the gradient of A would be exactly zero everywhere."""
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda x: (
            (0.1 * rng.standard_normal(x.shape)).astype(x.dtype)
            if x.dtype.kind == "f" and x.size > 1 and not np.any(x)
            else x
        ),
        params,
    )


def assert_close_tree(got, want, rtol):
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        err = np.abs(np.asarray(g) - np.asarray(w)).max() / max(np.abs(np.asarray(w)).max(), 1e-30)
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"


@pytest.mark.parametrize("strategy,linear,mesh", STRATEGY_CASES)
def test_strategy_matches_single_device(make_config, strategy, linear, mesh):
    cfg = par_config(make_config, strategy, linear, mesh)
    params, tokens, (ref_loss, ref_grads) = reference(cfg)
    loss, grads = loss_and_grads(cfg, params, tokens)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_close_tree(grads, ref_grads, 1e-5)


VARIANTS = {
    "gqa": {"model.n_kv_heads": 4},
    "sync_norm": {"parallel.online_norm": False},
    "sequence_parallel": {"parallel.strategy": "megatron", "parallel.sequence_parallel": True},
    "ungrouped": {"model.group_linears": False},
    "pallas_online_norm": {"kernels.rmsnorm": "pallas"},
    # the unrolled stack: the online norm's residual sums stored through a barrier (Block.stores_stream)
    "unrolled_online_norm": {"model.scan_unroll": True},
    "pallas_megatron": {"kernels.rmsnorm": "pallas", "parallel.strategy": "megatron"},
    # the residual adds deferred into the norms (model/transformer.py Block), the norm per shard
    "fused_residual_megatron": {
        "kernels.rmsnorm": "pallas",
        "kernels.residual_norm": "fused",
        "parallel.strategy": "megatron",
    },
    # ... and where rows are split along d (BTP without online norm): XLA's add and norm
    "fused_residual_sync_norm": {
        "parallel.online_norm": False,
        "kernels.rmsnorm": "pallas",
        "kernels.residual_norm": "fused",
    },
    # the MLP's gate product as the Pallas kernel (kernels/gate.py), once per shard: split along d_ff
    # under Megatron inside the data island's vmap, and along the batch under fsdp
    "gate_kernel_megatron": {"model.gate_kernel": "pallas", "parallel.strategy": "megatron"},
    "gate_kernel_fsdp": {"model.gate_kernel": "pallas", "mesh": (1, 2, 4), "parallel.strategy": "vanilla"},
    "gate_kernel_pipeline": {
        "model.gate_kernel": "pallas",
        "parallel.pipeline": 2,
        "model.n_layers": 4,
        "mesh": (1, 2, 2),
    },
    # the gate product inside the down projection's first GEMM (kernels/gated_gemm.py), once per shard:
    # along the batch under fsdp, in a pipeline's stages; where d_ff is split (Megatron) the gate kernel
    # and XLA's GEMM instead
    "gated_gemm_fsdp": {"model.gate_kernel": "gemm", "mesh": (1, 2, 4), "parallel.strategy": "vanilla"},
    "gated_gemm_pipeline": {
        "model.gate_kernel": "gemm",
        "parallel.pipeline": 2,
        "model.n_layers": 4,
        "mesh": (1, 2, 2),
        "parallel.strategy": "vanilla",
    },
    "gated_gemm_megatron": {"model.gate_kernel": "gemm", "parallel.strategy": "megatron"},
    "tied_embeddings_2x2x2": {"model.tie_embeddings": True, "mesh": (2, 2, 2)},
    "dense_ungrouped_2x2x2": {"model.linear": "dense", "model.group_linears": False, "mesh": (2, 2, 2)},
    "spatial_temporal_mlp_dense": {
        "parallel.linear_partition": "mlp_in=st,mlp_out=st",
        "model.linear": "dense",
        "parallel.strategy": "megatron",
        "mesh": (1, 2, 2),
    },
    "tt_pipeline_fsdp_remat": {
        "model.linear": "tt",
        "parallel.pipeline": 2,
        "model.n_layers": 4,
        "remat.policy": "lowrank",
        "mesh": (1, 2, 2),
    },
    "stage_remat_pipeline_lowrank": {
        "parallel.pipeline": 2,
        "model.n_layers": 4,
        "remat.pipeline": "stage",
        "remat.policy": "lowrank",
        "mesh": (1, 2, 2),
    },
    "stage_remat_pipeline_megatron_data": {
        "parallel.pipeline": 2,
        "model.n_layers": 4,
        "remat.pipeline": "stage",
        "parallel.strategy": "megatron",
        "mesh": (2, 1, 2),
    },
    "sltrain_pipeline_fsdp_remat": {
        "model.linear": "sltrain",
        "parallel.pipeline": 2,
        "model.n_layers": 4,
        "remat.policy": "lowrank",
        "mesh": (1, 2, 2),
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_match_single_device(make_config, variant):
    kw = dict(VARIANTS[variant])
    cfg = par_config(
        make_config, kw.pop("parallel.strategy", "btp"), kw.pop("model.linear", "cola"), kw.pop("mesh", (2, 1, 4)), **kw
    )
    params, tokens, (ref_loss, ref_grads) = reference(cfg)
    loss, grads = loss_and_grads(cfg, params, tokens)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_close_tree(grads, ref_grads, 1e-5)


# The training-curve tests: 4 logged steps, a checkpoint at the end.
CURVE = {"train.log_every": 1, "train.eval_every": 0, "train.steps": 4, "checkpoint.every": 4}
_SINGLE_RUNS: dict = {}


def single_device_run(make_config, tmp_path_factory):
    """The run dir of the one-device cola curve every training-curve test compares against, trained
    once per session (on one device every strategy's table shards nothing, so they share it)."""
    if "cola" not in _SINGLE_RUNS:
        run_dir = tmp_path_factory.mktemp("one_device")
        train.run(par_config(make_config, "btp", "cola", (1, 1, 1), run_dir=str(run_dir), **CURVE))
        _SINGLE_RUNS["cola"] = run_dir
    return _SINGLE_RUNS["cola"]


@pytest.mark.parametrize("strategy", ["btp", "vanilla", "megatron"])
def test_training_curve_matches_single_device(make_config, tmp_path, tmp_path_factory, strategy):
    one = single_device_run(make_config, tmp_path_factory)
    train.run(par_config(make_config, strategy, "cola", (2, 1, 4), run_dir=str(tmp_path / "many"), **CURVE))
    from tests_support import metric_rows

    a, b = metric_rows(one), metric_rows(tmp_path / "many")
    np.testing.assert_allclose([b[s] for s in range(1, 5)], [a[s] for s in range(1, 5)], rtol=2e-5)


def check_spatial_temporal(cfg) -> None:
    """Every projection group spatial-temporal: loss and every gradient match one device, and the
    step has no all-to-all and no integer (index) collective; the grid's weights and activations
    move by collective-permutes only."""
    params, tokens, (ref_loss, ref_grads) = reference(cfg)
    loss, grads, colls = loss_and_grads(cfg, params, tokens, collectives=True)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_close_tree(grads, ref_grads, 1e-5)
    kinds = {c.kind for c in colls}
    assert "all-to-all" not in kinds, kinds
    assert all(c.dtype.startswith(("f", "bf")) for c in colls), {(c.kind, c.dtype) for c in colls}
    # Traffic on both grid axes at once is the skews' and the Cannon diagonals': permutes only.
    assert {c.kind for c in colls if set(c.axes) == {"fsdp", "tensor"}} == {"collective-permute"}
    # FSDP gathers only the embedding table and the LM head: no projection weight is gathered.
    assert sum(c.kind == "all-gather" and "fsdp" in c.axes for c in colls) <= 2, colls


ST_LINEARS = ["dense", "lowrank", "cola"]


@pytest.mark.parametrize("mesh", [(1, 2, 2), (2, 2, 2)], ids=["fsdp2_tensor2", "data2_fsdp2_tensor2"])
@pytest.mark.parametrize("linear", ST_LINEARS)
def test_spatial_temporal_matches_single_device(make_config, linear, mesh):
    check_spatial_temporal(par_config(make_config, "btp", linear, mesh, **{"parallel.linear_partition": "st"}))


@pytest.fixture(scope="module")
def grid4_results() -> dict[str, str]:
    """The (fsdp, tensor) = (4, 4) checks need 16 devices; XLA's device count is fixed at jax
    import, so they run once in a subprocess (this file as a script) and report per kind."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=16").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "grid4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS ") :])


@pytest.mark.parametrize("linear", ST_LINEARS)
def test_spatial_temporal_4x4_matches_single_device(grid4_results, linear):
    assert grid4_results[linear] == "ok", grid4_results[linear]


def test_spatial_temporal_training_curve_matches_single_device(make_config, tmp_path, tmp_path_factory):
    """4 steps with every group spatial-temporal on (data, fsdp, tensor) = (2, 2, 2) follow the
    one-device curve, and the checkpoint they save holds the weights in the ordinary layout: it
    restores onto one device under plain BTP with the one-device run's values."""
    from boost_jax.runtime.checkpoints.store import restore

    one = single_device_run(make_config, tmp_path_factory)
    single = par_config(make_config, "btp", "cola", (1, 1, 1), run_dir=str(one), **CURVE)
    grid = par_config(
        make_config,
        "btp",
        "cola",
        (2, 2, 2),
        run_dir=str(tmp_path / "st"),
        **{"parallel.linear_partition": "st", **CURVE},
    )
    train.run(grid)
    from tests_support import metric_rows

    a, b = metric_rows(one), metric_rows(tmp_path / "st")
    np.testing.assert_allclose([b[s] for s in range(1, 5)], [a[s] for s in range(1, 5)], rtol=2e-5)
    abstract = {"params": build(single).spec.abstract["params"]}
    restored = {}
    for name, run_dir in (("one", one), ("st", tmp_path / "st")):
        got = restore(str(run_dir), abstract)
        assert got.step == 4
        restored[name] = got.state["params"]
    assert_close_tree(restored["st"], restored["one"], 1e-4)


# (pipeline, tensor, data) as the issue names them; 4 layers so every stage count divides them.
PIPELINE_MESHES = [(2, 4, 1), (2, 2, 2), (4, 2, 1)]


@pytest.mark.parametrize("mesh", PIPELINE_MESHES, ids=lambda m: "pp{}_tp{}_dp{}".format(*m))
@pytest.mark.parametrize("strategy", ["btp", "megatron"])
def test_pipeline_matches_single_device(make_config, strategy, mesh):
    pipeline, tensor, data = mesh
    cfg = par_config(
        make_config, strategy, "cola", (data, 1, tensor), **{"parallel.pipeline": pipeline, "model.n_layers": 4}
    )
    params, tokens, (ref_loss, ref_grads) = reference(cfg)
    loss, grads = loss_and_grads(cfg, params, tokens)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_close_tree(grads, ref_grads, 1e-5)


if __name__ == "__main__":  # the 16-device subprocess of grid4_results
    import tempfile
    import traceback

    flags = os.environ["XLA_FLAGS"]
    from conftest import small_config  # appends an 8-device flag: keep this process's 16

    os.environ["XLA_FLAGS"] = flags
    assert sys.argv[1:] == ["grid4"] and jax.device_count() >= 16, jax.device_count()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ST_LINEARS:
            try:
                check_spatial_temporal(
                    par_config(
                        lambda **kw: small_config(tmp, **kw),
                        "btp",
                        kind,
                        (1, 4, 4),
                        **{"parallel.linear_partition": "st"},
                    )
                )
                results[kind] = "ok"
            except Exception:  # noqa: BLE001 - report every kind, not just the first failure
                results[kind] = traceback.format_exc()
    print("RESULTS " + json.dumps(results))


def test_stage_remat_keeps_one_stage_input_per_microbatch(make_config):
    """remat.pipeline=stage: the compiled train step's temp memory grows with the micro-batch count by
    about one stage input per micro-batch, not by every layer's activations (GPipe's autodiff keeps)."""

    def temp(remat_stage, m):
        cfg = par_config(
            make_config,
            "btp",
            "cola",
            (1, 1, 2),
            **{
                "parallel.pipeline": 2,
                "model.n_layers": 4,
                "parallel.microbatches": m,
                "train.global_batch": 2 * m,
                "remat.pipeline": remat_stage,
                "model.d_model": 128,
                "model.d_ff": 256,
                "model.rank": 32,
                "train.seq_len": 32,
                "model.max_seq_len": 32,
            },
        )
        return build(cfg).lower_train().compile().memory_analysis().temp_size_in_bytes

    none4, none16 = temp("none", 4), temp("none", 16)
    stage4, stage16 = temp("stage", 4), temp("stage", 16)
    assert stage16 < 0.6 * none16, (stage16, none16)
    assert stage16 / stage4 < none16 / none4, (stage4, stage16, none4, none16)


# Each schedule x strategy, pipeline 2 on the 8-device mesh (the batch axes vary with the strategy so
# both replica kinds run): circular with V = 2 chunks of one layer per stage, at M = 4 (the ring's
# loop buffer holds an output two ticks) and M = S = 2 (stage S-1 hands straight to stage 0).
SCHEDULES = {
    "gpipe": {},
    "circular_v2": {"parallel.pipeline_schedule": "circular", "parallel.pipeline_repeats": 2},
    "circular_v2_m2": {
        "parallel.pipeline_schedule": "circular",
        "parallel.pipeline_repeats": 2,
        "parallel.microbatches": 2,
    },
}
SCHEDULE_MESHES = {"btp": (1, 2, 2), "megatron": (2, 1, 2), "vanilla": (2, 1, 2)}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("strategy", list(SCHEDULE_MESHES))
def test_pipeline_schedules_match_single_device(make_config, strategy, schedule):
    cfg = par_config(
        make_config,
        strategy,
        "cola",
        SCHEDULE_MESHES[strategy],
        **{"parallel.pipeline": 2, "model.n_layers": 4, **SCHEDULES[schedule]},
    )
    params, tokens, (ref_loss, ref_grads) = reference(cfg)
    loss, grads, colls = loss_and_grads(cfg, params, tokens, collectives=True)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_close_tree(grads, ref_grads, 1e-5)
    # The tick loop runs V M + S - 1 times: its stage hand-overs (one permute each way) say how often.
    p = cfg.parallel
    m, v = p.microbatches or 2 * p.pipeline, p.pipeline_repeats if p.pipeline_schedule == "circular" else 1
    trips = [c.trips for c in colls if c.kind == "collective-permute" and c.axes == ("pipeline",) and c.in_loop]
    assert len(trips) == 2 and set(trips) == {arithmetic.ticks(p.pipeline, m, v)} == {v * m + p.pipeline - 1}, trips
    # Of the S x ticks stage-ticks, V M S do work (every micro-batch crosses every stage V times).
    assert arithmetic.bubble_fraction(p.pipeline, m, v) == pytest.approx(1 - v * m / trips[0])


def test_megatron_sp_gathers_the_sequence_not_the_weights(make_config):
    """Megatron-SP on fsdp x tensor with more tokens per device than weight columns (where GSPMD, left
    free, gathers the column-parallel weights over `tensor` and moves the GEMM outputs to the heads /
    d_ff split by all-to-alls): loss and gradients match one device, and the compiled step moves the
    sequence instead, by all-gathers in front of those GEMMs (rules.regathered), with no all-to-all.
    (Their input gradients' reduce-scatters show as all-reduces in a CPU program.)"""
    cfg = par_config(
        make_config,
        "megatron",
        "dense",
        (1, 4, 2),
        **{"parallel.sequence_parallel": True, "train.global_batch": 64, "train.seq_len": 32},
    )
    params, tokens, (ref_loss, ref_grads) = reference(cfg)
    loss, grads, colls = loss_and_grads(cfg, params, tokens, collectives=True)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_close_tree(grads, ref_grads, 1e-5)
    assert "all-to-all" not in {c.kind for c in colls}, sorted({c.kind for c in colls})
    # the residual rows [B/fsdp, T, d] gathered over tensor (float32 here), a whole number of times per layer
    rows = 64 // 4 * 32 * 64
    gathered = [c for c in colls if c.kind == "all-gather" and c.axes == ("tensor",) and c.elements % rows == 0]
    assert gathered, [c for c in colls if c.axes == ("tensor",)]
