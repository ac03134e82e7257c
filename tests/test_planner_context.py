"""The planner under context parallelism (`parallel.context`, boost_jax/parallel/context.py): the
exchange it prices (ring / all_gather x full / bottleneck K/V) against the compiled step's
collectives over `context`, its peak memory per device against memory_analysis, the search picking
context where the rows run out (13B at seq 32k on 64 H100s), its exchange against the one formula,
and one-line errors for bad --context input."""

from pathlib import Path

import pytest

from boost_jax.config import base_config, sized_config
from boost_jax.parallel import strategies
from boost_jax.parallel.context import traffic
from boost_jax.planner import Mesh, Options, load_cluster, search
from boost_jax.planner.ops import cores
from boost_jax.planner.ops.operators import Block, Ctx
from boost_jax.planner.verify import MEMORY, MEMORY_TOLERANCE, compare

ROOT = Path(__file__).resolve().parents[1]
A100 = load_cluster(ROOT / "configs/clusters/a100_4x.py")
H100 = load_cluster(ROOT / "configs/clusters/h100_8x.py")
README_COMMAND = (
    "python -m boost_jax.plan --config configs/cola_13b.py --devices 64 --cluster "
    "configs/clusters/h100_8x.py --batch 4 --seq 32768 --top 3"
)


def context_config():
    """2 layers at d 256, seq 512: activations a good part of the peak, compiled in seconds."""
    c = base_config()
    c.model.update(
        d_model=256,
        n_heads=4,
        n_kv_heads=4,
        d_ff=688,
        rank=64,
        n_layers=2,
        vocab_size=512,
        max_seq_len=512,
        attention="chunked",
    )
    return c


@pytest.mark.parametrize(
    "mode,kv",
    [
        pytest.param("ring", "full", marks=pytest.mark.slow),
        ("ring", "bottleneck"),
        pytest.param("all_gather", "full", marks=pytest.mark.slow),  # the ring row's check (the suite's time)
        pytest.param("all_gather", "bottleneck", marks=pytest.mark.slow),
    ],
)
def test_verify_context_plan_agrees_with_the_compiled_step(mode, kv):
    """`plan --verify` on a context plan (btp, tensor 2 x context 2, 4 emulated devices): the
    exchange over `context` by kind, count and bytes per layer (collective-permutes; all-gathers and
    reduce-scatters), the tensor and data traffic (the weights' gradient all-reduced over context) and
    the whole program within 5%, and the peak memory per device within 15%, against the compiled
    programs; bottleneck moves r where full moves the device's kv_dim."""
    rows = compare(
        context_config(),
        A100,
        Mesh(1, 1, 2, context=2),
        "btp",
        batch=2,
        seq=512,
        memory=True,
        context_attention=mode,
        context_kv=kv,
    )
    names = [r["traffic"] for r in rows]
    exchange = [r for r in rows if r["traffic"].startswith("context")]
    kinds = {"ring": ["collective-permute"], "all_gather": ["all-gather", "reduce-scatter"]}[mode]
    assert [r["traffic"].split(": ")[1] for r in exchange] == kinds, names
    for r in rows:
        assert r["ok"] and r["measured"] > 0, r
        if r["counts"] is not None and not r["combined"]:
            assert r["counts"][0] == r["counts"][1], r
    assert names[-1] == MEMORY
    # 2 layers x 2 rows x 512 positions; width: the device's K/V heads (2 x 64) or the rank (64)
    width = 64 if kv == "bottleneck" else 128
    per_layer = {"ring": 2 * 3 * 2 * 512 // 2 * width, "all_gather": 2 * 2 * 512 * width}[mode]
    assert sum(r["measured"] for r in exchange) == 2 * per_layer * (2 if mode == "all_gather" else 1)  # bytes (bf16)


@pytest.mark.slow  # ~40 s cold: two compiles; the verify cases above check the memory at C=2
def test_context_memory_falls_with_c_as_compiled():
    """The planner's peak per device at context 1 and 2 (ring) against the compiled steps': both within
    the verify tolerance, and the drop from C=1 to C=2 (the activations per device halve) within 30%
    of the compiled drop."""
    peaks = {}
    for c in (1, 2):
        rows = compare(context_config(), A100, Mesh(1, 1, 2, context=c), "btp", batch=2, seq=512, memory=True)
        r = rows[-1]
        assert r["traffic"] == MEMORY and abs(r["predicted"] - r["measured"]) <= MEMORY_TOLERANCE * max(
            r["predicted"], r["measured"]
        ), r
        peaks[c] = r["predicted"], r["measured"]
    drop_p, drop_m = peaks[1][0] - peaks[2][0], peaks[1][1] - peaks[2][1]
    assert drop_m > 0 and drop_p == pytest.approx(drop_m, rel=0.30), peaks


def test_search_picks_context_at_32k_where_the_rows_run_out():
    """13B at seq 32k, batch 4 on 64 H100s: without context the 4 rows leave 16 devices per row to
    tensor parallelism (40 heads: across nodes, or mixed choices the trainer cannot run); the search
    picks a context plan, runnable, with its flags, much faster than the best plan without context.
    Its exchange is `traffic` of the config its flags give (one formula)."""
    from test_planner import with_overrides

    cfg = sized_config("13b", "cola")
    res = search(cfg, H100, 64, Options(batch=4, seq=32768, top=5), flops_per_token=1.0)
    best = res.best_runnable
    assert best is not None and best.mesh.context > 1 and res.plans[0].mesh.context > 1, [
        str(p.mesh) for p in res.plans
    ]
    assert f"--config.parallel.context={best.mesh.context} " in best.overrides
    flat = search(cfg, H100, 64, Options(batch=4, seq=32768, top=5, context=(1,)), flops_per_token=1.0)
    assert all(p.mesh.context == 1 for p in flat.plans)
    assert flat.plans[0].step_s > 2 * best.step_s
    assert flat.best_runnable is None or flat.best_runnable.step_s > 2 * best.step_s
    assert cfg.model.max_seq_len < 32768 and "--config.model.max_seq_len=32768 " in best.overrides
    cfg.data.source = "embedded"
    run = with_overrides(cfg, best.overrides)  # validated: the flags raise max_seq_len to the plan's seq
    formula = traffic(run)["per_layer"]
    priced = {}
    for c in best.layer_colls:
        if c.axis == "context":
            slot = priced.setdefault("forward" if c.phase == "fwd" else "backward", {}).setdefault(
                c.kind, {"count": 0, "elements": 0}
            )
            slot["count"] += 1
            slot["elements"] += c.elements
    assert {
        d: {k: {f: v[f] for f in ("count", "elements")} for k, v in ks.items()} for d, ks in formula.items()
    } == priced


def test_search_includes_context_modes_and_sizes():
    """At seq 32k on 8 devices with one row per step every divisor C of 8 is searched with ring and
    all_gather, and bottleneck K/V for CoLA (not for the dense twin); runnable bottleneck plans name a
    strategy that keeps the rank whole."""
    found = {}
    for linear in ("cola", "dense"):
        res = search(
            sized_config("7b", linear),
            H100,
            8,
            Options(batch=1, seq=32768, top=10_000, check_memory=False),
            flops_per_token=1.0,
        )
        found[linear] = {(p.mesh.context, p.context_attention, p.context_kv) for p in res.plans}
        for p in res.plans:
            if p.context_kv == "bottleneck" and p.runnable == "yes":
                assert strategies.registered(p.strategy).keeps_whole_rank
    modes = {(c, a, kv) for c in (2, 4, 8) for a in ("ring", "all_gather") for kv in ("full", "bottleneck")}
    assert modes <= found["cola"]
    assert {m for m in modes if m[2] == "full"} <= found["dense"] and not {
        m for m in found["dense"] if m[2] == "bottleneck"
    }
    assert (1, "", "") in found["cola"]


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
def test_remat_redoes_the_forward_of_the_exchange_only(mode):
    """Under remat.policy=full the attention's forward re-run redoes the forward's K/V rebuilds (2(C-1)
    B GEMMs: the remote blocks of K and V), not the backward's, and the ring's re-run hops overlap the
    re-run attention as the forward's do: its recompute time is the forward's time (its own cost
    without the backward) computed here from the op's parts."""
    from boost_jax.planner.pricing import cost as C

    c = 4
    block = Block.from_config(sized_config("7b", "cola"))
    ctx = Ctx(block, 2, 2 * 32768 // c, 32768, False, "chunked", 2, c, mode, "bottleneck")
    op = cores.attention(ctx, "H")
    rebuild = C.gemm_seconds(ctx.tokens, block.rank, block.kv_heads * block.head_dim / 2, H100)
    attn_fwd = C.attention_seconds(op.attn, "chunked", H100)[0]
    fwd = [x for x in op.colls if x.phase == "fwd"]
    hops = sum(C.coll_seconds(x, H100, 2) for x in fwd if x.kind == "collective-permute")
    rest = sum(C.coll_seconds(x, H100, 2) for x in fwd if x.kind != "collective-permute")
    elementwise = H100.elementwise_passes * op.acts * 2 / H100.hbm_bandwidth / 3
    want = 2 * (c - 1) * rebuild + attn_fwd + elementwise + rest + max(0.0, hops - (c - 1) / c * attn_fwd)
    got = C.price(op, H100, "full", "chunked", 2).recompute
    assert got == pytest.approx(want, rel=1e-9)
    assert len(op.gemms) == 2 * {"ring": 4 * c - 3, "all_gather": 3 * (c - 1)}[mode]  # forward and backward


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--context", "3"], "--context: 3 does not divide --devices 8"),
        (["--context", "8", "--seq", "24"], "--context: 8 devices hold 2 of 16 equal chunks"),
        (["--context", "2", "--attention", "xla"], "--context: --attention xla cannot run"),
        (["--context", "x"], "--context: expected a comma list"),
        (["--context-attention", "ulysses"], "--context-attention / --context-kv: ['ulysses']"),
    ],
)
def test_bad_context_input_is_one_line(argv, needle):
    from boost_jax import plan

    base = [
        "--config",
        str(ROOT / "configs/cola_7b.py"),
        "--devices",
        "8",
        "--cluster",
        str(ROOT / "configs/clusters/h100_8x.py"),
        "--batch",
        "1",
        "--seq",
        "4096",
    ]
    with pytest.raises(SystemExit) as e:
        plan.main(base + argv)
    message = str(e.value)
    assert needle in message and "\n" not in message, message


def test_readme_context_plan(capsys):
    """The README's planner command at seq 32k: the table shows the context column and the best plan
    runs with --config.parallel.context."""
    import shlex

    from boost_jax import plan

    assert plan.main(shlex.split(README_COMMAND)[3:]) == 0
    out = capsys.readouterr().out
    assert "| context C: attention / kv |" in out and "--config.parallel.context=" in out
    assert README_COMMAND in (ROOT / "docs" / "planner.md").read_text()
