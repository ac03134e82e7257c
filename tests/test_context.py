"""Context parallelism (`parallel.context`, boost_jax/parallel/context.py): the sequence split over a
`context` mesh axis in the load-balanced chunk layout, ring and all_gather attention, full or
bottleneck K/V. Loss and gradients equal one device's (float32) under btp, megatron and vanilla, with
fsdp, data, a pipeline, packed and document rows; the compiled exchange equals its formula; a run
resumed under another C continues the one-device loss curve on the same batches; the ring's permutes
are asynchronous around the block's compute in the deviceless H100 program; bad input is one line."""

import jax
import numpy as np
import pytest
from test_documents import LAYOUTS, _packed
from test_parallel import CURVE, assert_close_tree, loss_and_grads, par_config, reference, single_device_run

from boost_jax import train
from boost_jax.data import build_loaders
from boost_jax.errors import ConfigError
from boost_jax.parallel.context import chunk_order, layout, traffic, unlayout
from boost_jax.parallel.mesh import ONE_DEVICE
from boost_jax.runtime.build import build


def ctx_config(make_config, strategy, mesh, c, mode="ring", kv="full", **kw):
    """par_config's model (d 64, 8 heads, r 16, seq 16) on data x fsdp x tensor = mesh, context = c."""
    data, fsdp, tensor = mesh
    n = kw.get("parallel.pipeline", 1) * data * fsdp * tensor * c
    return par_config(
        make_config,
        strategy,
        kw.pop("linear", "cola"),
        mesh,
        **{
            "parallel.context": c,
            "parallel.context_attention": mode,
            "parallel.context_kv": kv,
            "model.attention": "chunked",
            "parallel.num_devices": n,
            **kw,
        },
    )


@pytest.mark.parametrize("c", [1, 2, 3, 4])
def test_layout_gives_every_device_chunks_i_and_2c_minus_1_minus_i(c):
    t = 2 * c * 3
    x = np.arange(t)
    laid = np.asarray(layout(x[None], c))[0]
    assert sorted(chunk_order(c)) == list(range(2 * c))
    per_device = laid.reshape(c, 2, 3)
    for d in range(c):
        np.testing.assert_array_equal(per_device[d, 0], np.arange(3) + 3 * d)
        np.testing.assert_array_equal(per_device[d, 1], np.arange(3) + 3 * (2 * c - 1 - d))
    np.testing.assert_array_equal(np.asarray(unlayout(laid[None], c))[0], x)
    # Causal balance: every device's queries see as many keys.
    work = [int(sum(q + 1 for q in per_device[d].ravel())) for d in range(c)]
    assert len(set(work)) == 1, work


CASES = {
    "btp_tp2_c4_ring": ("btp", (1, 1, 2), 4, "ring", "full", {}),
    "btp_data2_tp2_c2_all_gather": ("btp", (2, 1, 2), 2, "all_gather", "full", {}),
    "megatron_fsdp2_tp2_c2_ring_bottleneck": ("megatron", (1, 2, 2), 2, "ring", "bottleneck", {}),
    "btp_pipeline2_tp2_c2_ring": ("btp", (1, 1, 2), 2, "ring", "full", {"parallel.pipeline": 2, "model.n_layers": 4}),
}
SLOW_CASES = {  # rows whose paths the default rows take too (the suite's time)
    "btp_gqa_tp2_c4_ring_bottleneck": ("btp", (1, 1, 2), 4, "ring", "bottleneck", {"model.n_kv_heads": 4}),
    "megatron_tp2_c4_ring": ("megatron", (1, 1, 2), 4, "ring", "full", {}),
    # the residual adds deferred into the norms (per shard), the bottleneck ring's pre-normalised input
    "megatron_tp2_c2_ring_bottleneck_fused_residual": (
        "megatron",
        (1, 1, 2),
        2,
        "ring",
        "bottleneck",
        {"kernels.rmsnorm": "pallas", "kernels.residual_norm": "fused"},
    ),
    "megatron_sp_tp2_c2_ring": ("megatron", (1, 1, 2), 2, "ring", "full", {"parallel.sequence_parallel": True}),
    "vanilla_tp2_c2_ring": ("vanilla", (1, 1, 2), 2, "ring", "full", {}),
    "btp_c8_ring": ("btp", (1, 1, 1), 8, "ring", "full", {}),
    "btp_data2_c4_all_gather_bottleneck_accum2": (
        "btp",
        (2, 1, 1),
        4,
        "all_gather",
        "bottleneck",
        {"train.grad_accum": 2},
    ),
    "lowrank_pipeline2_c2_ring_bottleneck": (
        "btp",
        (1, 1, 2),
        2,
        "ring",
        "bottleneck",
        {"parallel.pipeline": 2, "model.n_layers": 4, "linear": "lowrank"},
    ),
    "tt_tp2_c2_ring_bottleneck": (
        "btp",
        (1, 1, 2),
        2,
        "ring",
        "bottleneck",
        {"linear": "tt", "model.tt_cores": 4, "model.tt_inner_rank": 4, "model.tt_activation": "silu"},
    ),
    "megatron_circular_c2_all_gather": (
        "megatron",
        (1, 1, 2),
        2,
        "all_gather",
        "full",
        {
            "parallel.pipeline": 2,
            "model.n_layers": 4,
            "parallel.pipeline_schedule": "circular",
            "parallel.pipeline_repeats": 2,
        },
    ),
}


@pytest.mark.parametrize("case", [*CASES, *(pytest.param(k, marks=pytest.mark.slow) for k in SLOW_CASES)])
def test_context_matches_single_device(make_config, case):
    strategy, mesh, c, mode, kv, extra = {**CASES, **SLOW_CASES}[case]
    cfg = ctx_config(make_config, strategy, mesh, c, mode, kv, **extra)
    params, tokens, (ref_loss, ref_grads) = reference(cfg)
    loss, grads = loss_and_grads(cfg, params, tokens)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert_close_tree(grads, ref_grads, 1e-5)


DOC_CASES = {
    "btp_c2_ring": ("btp", (1, 1, 2), 2, "ring", "full", {}),
    "megatron_c4_all_gather": ("megatron", (1, 1, 2), 4, "all_gather", "full", {}),
    "btp_c4_ring_bottleneck": ("btp", (1, 1, 2), 4, "ring", "bottleneck", {}),
}


@pytest.mark.parametrize(
    "case",
    ["btp_c2_ring", "btp_c4_ring_bottleneck"]
    + [pytest.param(c, marks=pytest.mark.slow) for c in ("megatron_c4_all_gather", "btp_pipeline2_c2_ring")],
)
def test_packed_rows_under_context(make_config, case):
    """Packed rows (several documents per row, positions restarting): one device's loss and gradients."""
    strategy, mesh, c, mode, kv, extra = DOC_CASES.get(
        case, ("btp", (1, 1, 2), 2, "ring", "full", {"parallel.pipeline": 2, "model.n_layers": 4})
    )
    cfg = ctx_config(make_config, strategy, mesh, c, mode, kv, **{"data.batching": "packed", **extra})
    single = cfg.copy_and_resolve_references()
    single.parallel.update(ONE_DEVICE, num_devices=1)
    params = jax.device_get(build(single).init_state()["params"])
    layouts = LAYOUTS + [[16], [4, 4, 4, 4], [1, 15], [10]]
    batch, _ = _packed(np.random.default_rng(c), layouts, cfg.train.seq_len, cfg.model.vocab_size)
    want_loss, want_grads = loss_and_grads(single, params, batch)
    loss, grads = loss_and_grads(cfg, params, batch)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    assert_close_tree(grads, want_grads, 1e-5)


def test_document_rows_under_context(make_config):
    """One document per row then padding (per-row lengths): one device's loss and gradients."""
    cfg = ctx_config(make_config, "megatron", (1, 1, 2), 2, "ring", **{"data.batching": "document"})
    single = cfg.copy_and_resolve_references()
    single.parallel.update(ONE_DEVICE, num_devices=1)
    params = jax.device_get(build(single).init_state()["params"])
    rng = np.random.default_rng(4)
    t = cfg.train.seq_len
    lengths = np.array([16, 3, 9, 1, 12, 2, 16, 7], np.int32)
    tokens = rng.integers(0, cfg.model.vocab_size, (8, t + 1)).astype(np.int32)
    batch = {"tokens": tokens, "lengths": lengths}
    want_loss, want_grads = loss_and_grads(single, params, batch)
    loss, grads = loss_and_grads(cfg, params, batch)
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    assert_close_tree(grads, want_grads, 1e-5)


def _exchange(cfg):
    """The compiled train step's collectives over `context` alone: {kind: {count, elements}}."""
    from boost_jax.tools.comm_report.command import context_section
    from boost_jax.tools.comm_report.tallies import tally_collectives
    from boost_jax.tools.hlo_comm import parse_collectives

    built = build(cfg)
    total = tally_collectives(parse_collectives(built.lower_train().compile().as_text(), built.mesh))
    return context_section(cfg, total)


@pytest.mark.parametrize(
    "mode,kv,c",
    [
        pytest.param("ring", "full", 4, marks=pytest.mark.slow),
        ("ring", "bottleneck", 4),
        ("all_gather", "full", 2),
        pytest.param("all_gather", "bottleneck", 2, marks=pytest.mark.slow),
    ],
)
def test_exchange_equals_formula(make_config, mode, kv, c):
    """What the comm report shows for context (kind, count, elements per step, read from the compiled
    step with its layer scan and grad_accum loop) equals `traffic`; bottleneck moves r where full
    moves the device's kv heads x head_dim."""
    cfg = ctx_config(make_config, "btp", (1, 1, 2), c, mode, kv, **{"train.grad_accum": 2})
    got = _exchange(cfg)
    assert got["compiled"] == got["formula"] and got["compiled"], got
    width = traffic(cfg)["width"]
    m = cfg.model
    assert width == (m.rank if kv == "bottleneck" else m.n_kv_heads // 2 * (m.d_model // m.n_heads))
    kind = "collective-permute" if mode == "ring" else "all-gather"
    rows, seq = cfg.train.global_batch // cfg.train.grad_accum, cfg.train.seq_len  # a micro-batch
    want = (2 * (c - 1) * rows * seq // c if mode == "ring" else 2 * rows * seq) * width
    assert traffic(cfg)["per_layer"]["forward"][kind]["elements"] == want


@pytest.mark.slow
def test_comm_report_cli_shows_the_context_exchange(tmp_path, capsys):
    from pathlib import Path

    from boost_jax.tools.comm_report import command as comm_report

    tiny = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.py")
    rep = comm_report.main(
        ["--config", tiny, "--mesh", "1,1,1,2,2", "--strategy", "btp", "--batch", "4", "--seq", "64", "--no-memory"]
    )
    col = rep["strategies"]["btp"]["context"]
    assert col["compiled"] == col["formula"] and col["compiled"]["collective-permute"]["count"] > 0
    out, err = capsys.readouterr()
    assert "train step, context (attention)" in out
    assert "comm_report: compiling btp forward at 1 layer (1 of 6; 0:" in err  # a line before each compile


def test_resume_under_another_context_size_continues_the_curve(make_config, tmp_path, tmp_path_factory):
    """Two steps with C = 2, then resumed with C = 4 (another mesh): the batches are the loader's
    whatever C is, and the losses are the one-device run's, step by step."""
    one = single_device_run(make_config, tmp_path_factory)
    run_dir = str(tmp_path / "ctx")
    first = ctx_config(
        make_config, "btp", (1, 1, 2), 2, run_dir=run_dir, **{**CURVE, "train.stop_at_step": 2, "checkpoint.every": 2}
    )
    second = ctx_config(make_config, "btp", (1, 1, 2), 4, run_dir=run_dir, **CURVE)
    for cfg in (first, second):  # the config par_config builds, on context
        cfg.model.attention = "auto"
    a, b = build_loaders(first)[0], build_loaders(second)[0]
    for i in range(4):
        np.testing.assert_array_equal(a.batch(i), b.batch(i))
    train.run(first)
    train.run(second)
    from tests_support import metric_rows

    want, got = metric_rows(one), metric_rows(run_dir)
    np.testing.assert_allclose([got[s] for s in range(1, 5)], [want[s] for s in range(1, 5)], rtol=2e-5)


def _one_line_error(cfg, *needles):
    with pytest.raises(ConfigError) as e:
        build(cfg)
    text = str(e.value)
    assert "\n" not in text and all(n in text for n in needles), text


@pytest.mark.parametrize(
    "change,needles",
    [
        ({"train.seq_len": 12, "parallel.context": 4}, ("parallel.context", "multiple of 8")),
        ({"model.attention": "xla"}, ("model.attention", "xla", "chunked")),
        ({"parallel.context_kv": "bottleneck", "model.linear": "dense"}, ("parallel.context_kv", "dense")),
        ({"parallel.context_kv": "bottleneck", "model.linear": "sltrain"}, ("parallel.context_kv", "sltrain")),
        ({"parallel.context_kv": "bottleneck", "parallel.strategy": "vanilla"}, ("parallel.context_kv", "vanilla")),
        ({"parallel.linear_partition": "st", "parallel.fsdp": 2}, ("parallel.linear_partition", "context")),
        ({"parallel.context_attention": "ulysses"}, ("parallel.context_attention", "ring")),
    ],
    ids=[
        "seq_not_2c_chunks",
        "attention_without_blocks",
        "bottleneck_dense",
        "bottleneck_sltrain",
        "bottleneck_vanilla",
        "spatial_temporal",
        "unknown_mode",
    ],
)
def test_bad_context_input_is_one_line(make_config, change, needles):
    kw = {
        "parallel.context": 2,
        "parallel.data": 1,
        "parallel.tensor": 2,
        "parallel.num_devices": 0,
        "model.attention": "chunked",
        **change,
    }
    c = kw["parallel.context"]
    kw["parallel.num_devices"] = c * kw["parallel.tensor"] * kw.get("parallel.fsdp", 1)
    cfg = make_config(**kw)
    _one_line_error(cfg, *needles)


def test_ring_permutes_overlap_the_block_compute_on_h100(make_config):
    """The deviceless H100 program (boost_jax/tools/aot.py): the ring's collective-permutes are
    asynchronous, and the block attention (its conditional and fusions) is scheduled between a
    permute's start and done."""
    import re

    from boost_jax.tools import aot

    if not aot.available():
        pytest.skip(f"needs the aot extra: {aot.INSTALL} ({aot.missing()})")
    cfg = make_config(
        **{
            "model.d_model": 64,
            "model.n_heads": 4,
            "model.n_kv_heads": 2,
            "model.d_ff": 128,
            "model.rank": 16,
            "model.dtype": "bfloat16",
            "model.attention": "chunked",
            "train.seq_len": 256,
            "model.max_seq_len": 256,
            "train.global_batch": 2,
            "parallel.data": 1,
            "parallel.context": 4,
            "parallel.num_devices": 4,
        }
    )
    built = build(cfg, aot.devices("h100", 4))
    lines = built.lower_train().compile().as_text().splitlines()
    starts, overlapped = {}, []
    for i, line in enumerate(lines):
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?\bcollective-permute-start\(", line)
        if m and '"is_sync":true' not in line:
            starts[m.group(1)] = i
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?\bcollective-permute-done\(%?([\w.\-]+)", line)
        if m and m.group(2) in starts:
            between = " ".join(lines[starts[m.group(2)] + 1 : i])
            overlapped.append(("conditional(" in between, " fusion(" in between))
    assert len(overlapped) >= 3 * (4 - 1), overlapped  # forward and backward sends of both layers
    assert sum(f for _, f in overlapped) >= len(overlapped) // 2, overlapped
    assert any(cond for cond, _ in overlapped), overlapped  # a block's attention runs while its successor moves


@pytest.mark.slow  # the benchmark's smoke run (the default suite's time)
def test_context_memory_benchmark_smoke(tmp_path):
    """benchmarks/context_memory.py at a small shape: rows for C = 1 and 2, the exchange for C = 2."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "context_memory.py"
    spec = importlib.util.spec_from_file_location("context_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "cm.json"
    bench.main(
        [
            "--models",
            "cola_60m",
            "--seqs",
            "64",
            "--contexts",
            "1,2",
            "--layers",
            "1",
            "--targets",
            "cpu",
            "--json",
            str(out),
            "--markdown",
            str(tmp_path / "cm.md"),
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["context"] for r in rows] == [1, 2] and all(r["temp_bytes"] > 0 for r in rows)
    ring = rows[1]["exchange"]
    assert ring["ring/bottleneck"]["collective-permute"] * 512 == ring["ring/full"]["collective-permute"] * 128
    assert "| cola_60m | 64 | 2 | cpu |" in (tmp_path / "cm.md").read_text()
