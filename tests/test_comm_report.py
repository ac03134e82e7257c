"""comm_report on a scaled-down MHA model (d=512, H=8, I=1376, r=128) on 4 emulated devices, and the
shardings CLI. Targets are the BOOST traffic formulas per token per layer on the tensor axis
(../shared/reference/boost.md): BTP 7r forward, 7r more backward; vanilla 5d+2I; Megatron 2d."""

import pytest

from boost_jax.config import base_config
from boost_jax.tools import shardings
from boost_jax.tools.comm_report import command as comm_report
from boost_jax.tools.comm_report import programs as comm_programs

D, H, I, R = 512, 8, 1376, 128
MESH = (1, 1, 4)
STATS = 8  # norm statistics riding with the A all-reduces: one scalar per token per norm (2 per layer)


def model_config():
    c = base_config()
    c.model.update(d_model=D, n_heads=H, n_kv_heads=H, d_ff=I, rank=R, n_layers=2, vocab_size=1024, max_seq_len=64)
    return c


@pytest.fixture(scope="module")
def columns():
    common = {"mesh": MESH, "batch": 2, "seq": 64, "dtype": "bfloat16", "memory": False}
    btp = comm_report.report(model_config(), strategies="btp", **common)  # all three programs
    # The baselines only need the forward and forward+backward programs (keeps the file fast).
    others = comm_report.report(
        model_config(), strategies="vanilla,megatron", programs=("forward", "forward_backward"), **common
    )
    return {**btp["strategies"], **others["strategies"]}


def tensor(col, direction):
    return col[f"per_layer_{direction}"]["tensor"]


def test_btp_forward_is_7r_in_4_collectives(columns):
    fwd = tensor(columns["btp"], "forward")
    assert abs(fwd["elements_per_token"] - 7 * R) <= 0.05 * 7 * R
    assert fwd["count"] <= 4
    assert "data_fsdp" not in columns["btp"]["per_layer_forward"]  # mesh has no batch axes


def test_btp_backward_mirrors_forward(columns):
    fwd, bwd = tensor(columns["btp"], "forward"), tensor(columns["btp"], "backward")
    assert fwd["elements_per_token"] + bwd["elements_per_token"] <= 14 * R + STATS
    assert bwd["elements_per_token"] >= 7 * R  # the B's input gradients: no reshard was dropped or added


def test_btp_train_step_adds_nothing_per_layer(columns):
    step = columns["btp"]["programs"]["train_step"]
    per_layer = step["per_layer"]["all-reduce@tensor"]["elements"] / columns["btp"]["tokens_per_device"]
    both = (
        tensor(columns["btp"], "forward")["elements_per_token"]
        + tensor(columns["btp"], "backward")["elements_per_token"]
    )
    assert per_layer == pytest.approx(both)
    # Once per step: the residual stream, split along d, is gathered before the final norm and head.
    (gather,) = [v for k, v in step["rest"].items() if k.startswith("all-gather")]
    assert gather["count"] == 1 and gather["elements"] == columns["btp"]["tokens_per_device"] * D


@pytest.fixture(scope="module")
def bottleneck_kinds():
    """BTP forward traffic of the tensor-train (6 cores through r_mid = R) and sparse + low-rank kinds."""
    out = {}
    for linear, fields in {
        "tt": dict(tt_cores=6, tt_inner_rank=R // 4, tt_activation="silu"),
        "sltrain": dict(sparse_block=16, sparse_density=0.03),
    }.items():
        c = model_config()
        c.model.update(linear=linear, **fields)
        out[linear] = comm_report.report(
            c, strategies="btp", programs=("forward",), mesh=MESH, batch=2, seq=64, dtype="bfloat16", memory=False
        )["strategies"]["btp"]
    return out


def test_tt_btp_forward_is_7_rmid_in_4_collectives(bottleneck_kinds):
    fwd = tensor(bottleneck_kinds["tt"], "forward")
    assert abs(fwd["elements_per_token"] - 7 * R) <= 0.05 * 7 * R
    assert fwd["count"] <= 4


def test_sltrain_btp_forward_shows_the_sparse_gathers(bottleneck_kinds):
    """S·x reads whole input rows: on top of the low-rank part's 7r, each projection group's input is
    all-gathered over the tensor axis once (d for q/k/v, H·dh for o, d for gate/up, I for down; the
    report counts a gather's output elements), and nothing else is added."""
    fwd = tensor(bottleneck_kinds["sltrain"], "forward")
    assert fwd["elements_per_token"] == pytest.approx(7 * R + 3 * D + I, rel=0.02)
    assert fwd["count"] <= 4 + 4 + 2  # the A all-reduces, one gather per group, the norm scales


def test_vanilla_pays_full_output_widths(columns):
    fwd = tensor(columns["vanilla"], "forward")
    assert fwd["elements_per_token"] >= 4 * D + 2 * I


def test_megatron_dense_is_2d(columns):
    col = columns["megatron"]
    assert col["linear"] == "dense"  # bare `megatron` measures the full-rank twin
    assert abs(tensor(col, "forward")["elements_per_token"] - 2 * D) <= 0.05 * 2 * D
    assert abs(tensor(col, "backward")["elements_per_token"] - 2 * D) <= 0.05 * 2 * D


def test_strategy_spec_parsing():
    assert comm_programs.parse_strategies("btp,megatron:cola") == [("btp", None), ("megatron", "cola")]
    cfg = comm_programs.variant_config(model_config(), "megatron", "cola", MESH, 2, 64, "bfloat16")
    assert cfg.model.linear == "cola"
    with pytest.raises(SystemExit, match="--strategy"):
        comm_programs.parse_strategies("btp,zero")


def test_shardings_cli_puts_tensor_on_btp_a_input_dim(capsys, tmp_path):
    cfg_file = tmp_path / "small.py"
    cfg_file.write_text(
        "from boost_jax.config import base_config\n\ndef get_config():\n"
        f"    c = base_config()\n    c.model.update(d_model={D}, n_heads={H}, n_kv_heads={H}, "
        f"d_ff={I}, rank={R})\n    return c\n"
    )
    shardings.main(["--config", str(cfg_file), "--mesh", "1,1,4", "--strategy", "btp", "--show", "layers/attn/q/a"])
    out = capsys.readouterr().out
    table, drawing = out.split("\n\n", 1)
    rows = {line.split()[0]: line for line in table.splitlines()}
    # [layers, d_in, r]: the A factor is row-parallel, split along its input (d) dim only.
    assert rows["layers/attn/q/a"].rstrip().endswith("P(None, 'tensor')")
    assert "(layers, embed, rank)" in rows["layers/attn/q/a"]
    assert rows["layers/attn/q/b"].rstrip().endswith("P(None, None, 'tensor')")  # B column-parallel
    assert "drawing layer 0's [512, 128] slice" in drawing and "CPU 3" in drawing


def test_pipeline_report_shows_collective_permutes():
    from boost_jax.config import base_config
    from boost_jax.tools.comm_report.pipeline import pipeline_report

    cfg = base_config()
    cfg.model.update(n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, d_ff=128, rank=16)
    rep = pipeline_report(cfg, (2, 1, 1, 2), "btp", batch=8, seq=16, dtype="float32")
    permutes = [c for c in rep["collectives"] if c["kind"] == "collective-permute" and c["axes"] == ["pipeline"]]
    assert permutes and permutes[0]["count"] >= rep["ticks"] - 1  # stage outputs shift at least once a tick
    assert rep["bubble"] == (2 - 1) / (4 + 2 - 1)


@pytest.mark.slow  # a second pipeline compile (the default suite's time)
def test_pipeline_report_shows_1f1b_hand_overs():
    """1F1B: one hand-over each way per lockstep tick (4 + 2 of them; unrolled, XLA drops the last
    tick's forward one, which nothing reads, and the first tick's backward one, which sends zeros), the
    bubble of GPipe's."""
    from boost_jax.config import base_config
    from boost_jax.tools.comm_report.pipeline import pipeline_report

    cfg = base_config()
    cfg.model.update(n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, d_ff=128, rank=16)
    rep = pipeline_report(cfg, (2, 1, 1, 2), "btp", batch=8, seq=16, dtype="float32", schedule="1f1b")
    permutes = [c for c in rep["collectives"] if c["kind"] == "collective-permute" and c["axes"] == ["pipeline"]]
    assert (rep["schedule"], rep["ticks"], rep["bubble"]) == ("1f1b", 6, (2 - 1) / (4 + 2 - 1))
    assert len(permutes) == 1 and 2 * rep["ticks"] - 2 <= permutes[0]["count"] <= 2 * rep["ticks"]


def test_collectives_in_loops_count_once_per_trip():
    """The chunked loss scans over position chunks with vocab-parallel reductions inside (a while loop
    that scan_unroll does not unroll): the report counts them per trip, so two chunks of 32 positions
    execute the elements of the loss in one piece of 64."""
    common = {"mesh": MESH, "batch": 2, "seq": 64, "dtype": "float32", "memory": False, "programs": ("forward",)}
    rests = {}
    for chunk in (0, 32):
        c = model_config()
        c.model.loss_chunk = chunk
        col = comm_report.report(c, strategies="btp", **common)["strategies"]["btp"]
        rests[chunk] = col["programs"]["forward"]["rest"]
    assert rests[0]["all-reduce@tensor"]["count"] > 0  # the loss does reduce over the split vocabulary
    for key, one in rests[0].items():
        two = rests[32][key]
        assert (two["elements"], two["bytes"]) == (one["elements"], one["bytes"]), key
        assert two["count"] == (2 * one["count"] if key.startswith("all-reduce") else one["count"]), key
