"""`python -m boost_jax.tools.plot RUN_DIR` draws a run's curves to a PNG."""
import json

import pytest

from boost_jax import train
from boost_jax.tools import plot

pytest.importorskip("matplotlib")
PNG = b"\x89PNG\r\n\x1a\n"


def test_plots_a_tiny_runs_metrics(make_config, tmp_path):
    cfg = make_config(**{"train.steps": 4, "train.log_every": 1, "train.eval_every": 2, "checkpoint.every": 4})
    train.run(cfg)
    out = tmp_path / "curves.png"
    assert plot.main([cfg.run_dir, "--out", str(out)]) == 0
    assert out.read_bytes().startswith(PNG) and out.stat().st_size > 10_000


def test_mfu_panel_resumed_rows_and_errors(tmp_path, capsys):
    rows = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 1e5, "mfu": 0.4} for s in range(1, 6)]
    rows += [{"step": 4, "loss": 4.0}, {"step": 5, "eval_loss": 4.1}]  # a resume redid step 4
    text = "\n".join(json.dumps(r) for r in rows) + '\n{"step": 6, "lo'  # cut short by a crash
    (tmp_path / "metrics.jsonl").write_text(text)
    m = plot.read_metrics(tmp_path)
    assert m["loss"][4] == 4.0 and 6 not in m["loss"] and m["mfu"][1] == 0.4
    assert plot.main([str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").read_bytes().startswith(PNG)
    assert plot.main([str(tmp_path / "missing")]) == 1
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
