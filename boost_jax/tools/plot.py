"""Training curves of a run: `python -m boost_jax.tools.plot RUN_DIR [--out PNG]`.

Reads RUN_DIR/metrics.jsonl and draws three panels: train and eval loss, tokens/s, and MFU (TFLOP/s
per device where MFU is unknown, e.g. on CPU). Writes RUN_DIR/curves.png unless --out says otherwise.
Needs matplotlib: `pip install matplotlib` (the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from boost_jax.errors import install_hint


def read_metrics(run_dir) -> dict[str, dict[int, float]]:
    """{metric: {step: value}}. A resumed run appends rows for steps it redoes: the last row wins, as
    it is the one the surviving checkpoints continue from. A line that is not a JSON object with a
    numeric step (cut short by a crash, damaged) is skipped and counted in one note on stderr."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} does not exist: pass the run_dir a training run wrote (it holds metrics.jsonl)"
        )
    series: dict[str, dict[int, float]] = {}
    damaged = 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        step = row.pop("step", None) if isinstance(row, dict) else None
        if not _is_number(step):
            damaged += 1
            continue
        for key, value in row.items():
            if _is_number(value):
                series.setdefault(key, {})[int(step)] = float(value)
    if damaged:
        print(f"note: skipped {damaged} damaged line(s) in {path}", file=sys.stderr)
    return series


def _is_number(x) -> bool:
    """A finite int or float (json.loads reads NaN/Infinity; bools are ints)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _line(ax, series: dict[int, float], **kw) -> None:
    steps = sorted(series)
    ax.plot(steps, [series[s] for s in steps], **kw)


def drawable(text: str) -> str:
    """`text` (the run's directory name, the one text a user picks) with each character the plot's
    font has no glyph for (CJK, say, in DejaVu Sans) replaced by "?": matplotlib would draw an empty
    box and warn about each one."""
    from matplotlib.font_manager import FontProperties, findfont, get_font

    have = get_font(findfont(FontProperties())).get_charmap()  # the default font, which titles use
    return "".join(c if ord(c) in have or not c.isprintable() else "?" for c in text)


def plot(run_dir, out=None) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(f"boost_jax.tools.plot needs matplotlib: {install_hint('bench')}") from None
    m = read_metrics(run_dir)
    if not m.get("loss") and not m.get("eval_loss"):
        raise SystemExit(f"{Path(run_dir) / 'metrics.jsonl'} has no loss or eval_loss rows yet")
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig, (loss_ax, tok_ax, mfu_ax) = plt.subplots(1, 3, figsize=(15, 4), constrained_layout=True)
    if m.get("loss"):
        _line(loss_ax, m["loss"], label="train", lw=1)
    if m.get("eval_loss"):
        _line(loss_ax, m["eval_loss"], label="eval", marker="o", ms=3)
    loss_ax.set(title="loss", xlabel="step", ylabel="cross-entropy (nats/token)")
    loss_ax.legend()
    if m.get("tokens_per_s"):
        _line(tok_ax, m["tokens_per_s"])
    tok_ax.set(title="throughput", xlabel="step", ylabel="tokens/s")
    if m.get("mfu"):
        _line(mfu_ax, {s: 100 * v for s, v in m["mfu"].items()})
        mfu_ax.set(title="MFU", ylabel="% of dense bf16 peak")
    else:  # the device's peak is unknown (CPU, or a GPU missing from metrics.PEAK_BF16_FLOPS)
        if m.get("tflops_per_device"):
            _line(mfu_ax, m["tflops_per_device"])
        mfu_ax.set(title="MFU n/a (peak unknown); TFLOP/s per device", ylabel="TFLOP/s per device")
    mfu_ax.set_xlabel("step")
    for ax in (loss_ax, tok_ax, mfu_ax):
        ax.grid(alpha=0.3)
    run = Path(run_dir).resolve()
    fig.suptitle(drawable(f"{run.parent.name}/{run.name}"))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a training run's directory (holds metrics.jsonl)")
    ap.add_argument("--out", default="", help="PNG to write (default RUN_DIR/curves.png)")
    args = ap.parse_args(argv)
    try:
        print(plot(args.run_dir, args.out or None))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
