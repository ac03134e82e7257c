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


def test_a_run_dir_named_in_glyphs_the_font_lacks_plots_without_a_warning(tmp_path):
    """The title is the run's directory name: characters the plot's font has no glyph for (CJK in
    DejaVu Sans) are drawn as "?", without matplotlib's missing-glyph warning."""
    import warnings

    run = tmp_path / "运行_σ"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) for s in (1, 2)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert plot.main([str(run)]) == 0
    assert not [w for w in caught if "Glyph" in str(w.message)], [str(w.message) for w in caught]
    assert plot.drawable(f"{tmp_path.name}/运行_σ") == f"{tmp_path.name}/??_σ"  # σ: DejaVu has it


def test_damaged_lines_are_skipped_and_counted(tmp_path, capsys):
    good = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.5}]
    lines = [
        json.dumps(good[0]),
        "\x00\x00garbage",
        "[1, 2]",
        '"text"',
        '{"loss": 9.0}',
        '{"step": NaN}',
        "",
        json.dumps(good[1]),
        '{"step": 3, "lo',
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    m = plot.read_metrics(tmp_path)
    assert m == {"loss": {1: 5.0, 2: 4.5}}
    err = capsys.readouterr().err
    assert err == f"note: skipped 6 damaged line(s) in {tmp_path / 'metrics.jsonl'}\n"
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in good) + "\n")
    plot.read_metrics(tmp_path)
    assert capsys.readouterr().err == ""  # a whole file: no note


def test_writer_sets_a_torn_last_line_aside(tmp_path, capsys):
    """A run killed mid-write leaves half a row; the next writer moves it to metrics.jsonl.torn and
    starts on a fresh line, so every row of metrics.jsonl parses."""
    from boost_jax.runtime.metrics import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    half = '{"step": 3, "loss": 4.'
    path.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.5}\n' + half)
    writer = MetricsWriter(str(tmp_path))
    writer.write(3, {"loss": 4.25})
    writer.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["loss"] == 4.25
    assert (tmp_path / "metrics.jsonl.torn").read_text() == half + "\n"
    assert "metrics.jsonl.torn" in capsys.readouterr().err

    path.write_text(half)  # no newline at all: the whole file is the torn row; appended to the side file
    MetricsWriter(str(tmp_path), enabled=True).close()
    assert path.read_text() == "" and (tmp_path / "metrics.jsonl.torn").read_text() == 2 * (half + "\n")
    path.write_text('{"step": 1}\n')  # whole: untouched
    MetricsWriter(str(tmp_path)).close()
    assert path.read_text() == '{"step": 1}\n'
    plot.read_metrics(tmp_path)
    assert "damaged" not in capsys.readouterr().err


def test_torn_tail_found_across_read_blocks(tmp_path):
    from boost_jax.runtime.metrics import set_aside_torn_tail

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n' + b"x" * 100)
    assert set_aside_torn_tail(str(path), block=7) == 100
    assert path.read_bytes() == b'{"step": 1}\n'
    assert (tmp_path / "metrics.jsonl.torn").read_bytes() == b"x" * 100 + b"\n"
