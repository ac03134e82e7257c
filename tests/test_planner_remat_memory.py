"""The pipelined plans' memory under a layer remat policy (planner/pricing/memory.py): the circular GPU tick
loop stacks every tick's selected float32 chunk (`remat_chunks`), counted here by hand from the model's
widths; GPipe's tick backward holds the tick's stage gradient beside the accumulator, checked against the
compiled CPU step; a small circular remat-full plan's price against its deviceless A100 compile."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_planner import A100
from test_planner_pipeline import check_rows, small_config

from boost_jax.planner import Mesh, Options, plan_for
from boost_jax.planner.verify import MEMORY_TOLERANCE, compare_pipeline, uniform_layer
from boost_jax.tools import aot
from boost_jax.tools.devices import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_circular_remat_prices_every_ticks_float32_chunk():
    """llama_13b on pipeline 4 x fsdp 4 x tensor 4 (megatron-SP), circular, remat full: the kept weights are
    V M + S - 1 ticks x L/(S V) layers of one layer's float32 weights per tensor shard, gathered over fsdp
    (q, k, v, o, gate, up, down, counted from the widths); GPipe (loop-invariant stage weights) and
    remat.pipeline=stage (the chunk selected again in the tick's backward) keep none of them."""
    rng = np.random.default_rng()
    cfg = load_config(str(ROOT / "configs" / "llama_13b.py"))
    m = cfg.model
    stages, fsdp, tensor = 4, 4, 4
    repeats, micro = int(rng.choice([2, 5, 10])), int(rng.choice([4, 8, 16]))
    mesh, layer = Mesh(1, fsdp, tensor, pipeline=stages), uniform_layer(cfg, "megatron", True)
    opts = Options(batch=512, seq=256, check_memory=False)

    def weights(schedule="circular", stage_remat="none", remat="full"):
        v = repeats if schedule == "circular" else 1
        p = plan_for(cfg, A100, mesh, 1, remat, layer, opts, None, micro, schedule, v, stage_remat)
        return p.memory["weights"]

    head = m.d_model // m.n_heads
    attention = m.d_model * head * (2 * m.n_heads + 2 * m.n_kv_heads)  # q and o, k and v
    per_layer = (attention + 3 * m.d_model * m.d_ff) / tensor
    ticks = repeats * micro + stages - 1
    chunk = m.n_layers // (stages * repeats)
    assert weights() == pytest.approx(ticks * chunk * per_layer * 4, rel=1e-3), (repeats, micro)
    assert weights("gpipe") == weights(stage_remat="stage") == 0.0
    # without remat the GEMMs' bf16 casts are the stacked residuals instead
    assert weights(remat="none") == pytest.approx(ticks * chunk * per_layer * 2, rel=1e-3)


@pytest.mark.slow  # a CPU compile of the small pipelined model on 4 emulated devices (about 10 s here)
@pytest.mark.parametrize("remat", ["full", "lowrank"])
def test_gpipe_remat_holds_the_ticks_stage_gradient_beside_the_accumulator(remat):
    """`plan --verify` on GPipe over pipeline 2 x fsdp 2 x tensor 2 with a layer remat policy (no stage
    remat): the peak memory within 15% of the compiled float32 step, whose tick backward writes the
    stage's gradient into a fresh stack beside the accumulator (priced without it, the plan fails)."""
    rows = compare_pipeline(
        small_config(), A100, Mesh(1, 2, 2, 2), "btp", remat=remat, microbatches=4, seq=32, layers_per_chunk=2
    )
    check_rows(rows)


@pytest.mark.slow  # a deviceless 8-GPU compile of an 8-layer llama_1b (about 30 s here)
@pytest.mark.skipif(not aot.available(), reason=f"needs the aot extra: {aot.INSTALL}")
def test_circular_remat_plan_is_not_under_its_a100_compile(tmp_path):
    """llama_1b's widths with 8 layers, circular V 2 over pipeline 2 x fsdp 2 x tensor 2 (megatron-SP), M 4,
    remat full: the planner's peak per GPU within MEMORY_TOLERANCE of the deviceless A100 compile's (as
    `plan --verify` checks it). Without the stacked float32 chunks the price is far under the compile."""
    flags = [
        "--config.model.n_layers=8",
        "--config.parallel.pipeline=2",
        "--config.parallel.data=1",
        "--config.parallel.fsdp=2",
        "--config.parallel.tensor=2",
        "--config.parallel.strategy=megatron",
        "--config.parallel.sequence_parallel=true",
        "--config.parallel.microbatches=4",
        "--config.parallel.pipeline_schedule=circular",
        "--config.parallel.pipeline_repeats=2",
        "--config.train.global_batch=32",
        "--config.train.grad_accum=1",
        "--config.train.seq_len=256",
        "--config.remat.policy=full",
        "--config.model.scan_unroll=false",
    ]
    config = str(ROOT / "configs" / "llama_1b.py")
    cfg = aot.load(config, flags)
    plan = plan_for(
        cfg,
        A100,
        Mesh(1, 2, 2, pipeline=2),
        1,
        "full",
        uniform_layer(cfg, "megatron", True),
        Options(batch=32, seq=256, check_memory=False),
        microbatches=4,
        schedule="circular",
        repeats=2,
    )
    out = tmp_path / "aot.json"
    command = [sys.executable, "-m", "boost_jax.tools.aot", "--target", "a100_40gb", "--devices", "8"]
    command += ["--config", config, "--train-only", "--json", str(out), *flags]
    # XLA reads XLA_FLAGS once per process: the compile runs in its own
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run(command, check=True, env=env, capture_output=True, cwd=ROOT)
    ratio = plan.memory["total"] / json.loads(out.read_text())["train"]["peak_bytes"]
    assert abs(ratio - 1) <= MEMORY_TOLERANCE, (ratio, {k: round(v / 1e9, 2) for k, v in plan.memory.items()})
