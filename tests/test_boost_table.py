"""benchmarks/boost_table.py, BOOST's table re-priced: every recorded step-time table is the program its row
names (config, mesh, remat, tokens, strategy), the planner prices every row, and the table's speedups are
the rows' own ratios. The default tests read the recorded JSONs (seconds); the recording command that
docs/planner.md shows compiles a 3B program (`-m slow`)."""

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from boost_jax.tools import aot

ROOT = Path(__file__).resolve().parents[1]
# the recording command docs/planner.md shows (tests/test_readme.py COMMANDS)
DOCS_COMMAND = (
    "python -m boost_jax.tools.aot --target a100_40gb --devices 2 --config configs/cola_3b.py --mesh 1,1,2 "
    "--train-only --profile --config.parallel.strategy=btp --config.train.seq_len=4096 "
    "--config.train.global_batch=4 --config.train.grad_accum=4 --config.remat.policy=none "
    "--config.model.max_seq_len=4096 --json benchmarks/boost_table/cola_3b_btp_a100_40gb.json"
)


@pytest.fixture(scope="module")
def bt():
    spec = importlib.util.spec_from_file_location("boost_table", ROOT / "benchmarks" / "boost_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TARGETS = ["a100_40gb", "h100"]


@pytest.fixture(scope="module")
def rows(bt):
    return {target: bt.rows(target) for target in TARGETS}


@pytest.mark.parametrize("target", TARGETS)
def test_every_row_recorded_and_priced_by_the_planner(bt, rows, target):
    """Twelve rows per GPU (3B, 7B, 13B at remat none and full x full-rank / vanilla / BTP), each a recorded
    table and a planner price; the paper's numbers on the A100's 7B rows alone."""
    rs = rows[target]
    assert [(r["size"], r["remat"], r["strategy"]) for r in rs] == [
        (s, remat, st) for s, _, _, remat in bt.SHAPES for _, st, _ in bt.STRATEGIES
    ]
    assert len(rs) == 12
    assert all(r["table_ms"] > 0 and r["planner_ms"] > 0 for r in rs)
    paper = {("7b", "megatron"): 1060.0, ("7b", "vanilla"): 1640.0, ("7b", "btp"): 720.0}
    assert {(r["size"], r["strategy"]): r["paper_ms"] for r in rs if r["paper_ms"]} == (
        paper if target == "a100_40gb" else {}
    )


def test_the_docs_command_is_the_rows_command(bt):
    assert bt.command("cola_3b", "btp", 2, 1) == DOCS_COMMAND


def _record(bt, config):
    return json.loads(bt.path_of(config, "btp").read_text())


@pytest.mark.parametrize("wrong", ["strategy", "mesh", "remat", "tokens", "config", "profile"])
def test_a_record_not_its_rows_program_fails(bt, wrong):
    """A BTP record checked as its own row passes; changed in one respect (or read as the vanilla row), the
    check names the file and the command to rerun."""
    rec = _record(bt, "cola_3b")
    cfg = bt.model_config("cola_3b")
    bt.check(rec, cfg, "cola_3b", "btp", 2, 1, "here")
    bad, strategy, model = copy.deepcopy(rec), "btp", cfg
    if wrong == "strategy":
        strategy = "vanilla"
    elif wrong == "mesh":
        bad["mesh"]["tensor"] = 4
    elif wrong == "remat":
        bad["resolved"]["remat.policy"] = "full"
    elif wrong == "tokens":  # a step of half the tokens
        bad["profile"]["flops_by_category"]["gemm"] /= 2
    elif wrong == "config":
        model = bt.model_config("cola_7b")
    else:
        del bad["profile"]
    with pytest.raises(ValueError, match=r"here: .*rerun `python -m boost_jax\.tools\.aot"):
        bt.check(bad, model, "cola_3b", strategy, 2, 1, "here")


@pytest.mark.parametrize("target", TARGETS)
def test_the_table_and_its_speedups_come_from_the_rows(bt, rows, target, tmp_path, capsys):
    """`python benchmarks/boost_table.py` (docs/planner.md; `--target h100`): each printed ms is its row's,
    each speedup the ratio of the printed ms (full-rank or vanilla over BTP), "n/a" where the paper measured
    none; the JSON holds the same."""
    assert bt.main(["--out", str(tmp_path), "--target", target]) == 0
    out = capsys.readouterr().out
    name = "boost_table" if target == "a100_40gb" else f"boost_table_{target}"
    assert out.strip() == (tmp_path / f"{name}.md").read_text().strip()
    rows = rows[target]
    tables = [
        [[c.strip() for c in ln.strip("|").split("|")] for ln in block.splitlines()[2:]]
        for block in out.split("\n\n")[:2]
    ]
    rows_md, ups_md = tables
    assert len(rows_md) == 12 and len(ups_md) == 4
    ms = {}
    for cells, r in zip(rows_md, rows):
        assert cells[2:4] == [r["remat"], f"{r['name']} ({r['strategy']})"]
        assert float(cells[4]) == pytest.approx(r["table_ms"], abs=0.05)
        assert float(cells[5]) == pytest.approx(r["planner_ms"], abs=0.05)
        assert float(cells[6]) == pytest.approx(float(cells[5]) / float(cells[4]), abs=2e-3)
        assert cells[7] == ("n/a" if r["paper_ms"] is None else f"{r['paper_ms']:.1f}")
        ms[(r["size"], r["remat"], r["strategy"])] = [float(cells[4]), float(cells[5]), r["paper_ms"]]
    for cells, (size, _, _, remat) in zip(ups_md, bt.SHAPES):
        assert cells[2] == remat
        for col, base in ((3, "megatron"), (4, "vanilla")):
            for i, got in enumerate(cells[col].split(" / ")):
                want = ms[(size, remat, base)][i]
                if want is None:
                    assert got == "n/a"
                else:
                    assert float(got.rstrip("x")) == pytest.approx(want / ms[(size, remat, "btp")][i], abs=0.006)
    saved = json.loads((tmp_path / f"{name}.json").read_text())
    assert saved["target"] == target and saved["rows"] == json.loads(json.dumps(rows))
    if target == "a100_40gb":
        assert saved["speedups"][1]["paper_vs_megatron"] == pytest.approx(1060 / 720)
        assert saved["speedups"][1]["paper_vs_vanilla"] == pytest.approx(1640 / 720)


def test_a_missing_record_is_a_one_line_error(bt, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bt, "ROOT", tmp_path)
    assert bt.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing; record it with `python -m boost_jax.tools.aot" in err


@pytest.mark.slow  # a full-size 3B compile for 2 deviceless A100s (about a minute)
@pytest.mark.skipif(not aot.available(), reason=f"needs the aot extra ({aot.missing()})")
def test_the_recording_command(bt, monkeypatch, tmp_path):
    """docs/planner.md's recording command, run from the repository root into a scratch JSON: the program
    of the cola_3b BTP row, priced as its recorded table (a moved program: rerun the rows' commands)."""
    monkeypatch.chdir(ROOT)
    args = DOCS_COMMAND.split()[3:]
    args[args.index("--json") + 1] = str(tmp_path / "row.json")
    rep = aot.main(args)
    bt.check(rep, bt.model_config("cola_3b"), "cola_3b", "btp", 2, 1, "the compile")
    recorded = _record(bt, "cola_3b")["profile"]["predicted_step_s"]
    assert rep["profile"]["predicted_step_s"] == pytest.approx(recorded, rel=0.02)
