"""Perplexity of a saved run:

    python -m boost_jax.evaluate --checkpoint RUN_DIR [--split eval|train] [--batches N] [--json OUT]
        [--config.data.source=text --config.data.path=/data/val.txt ...] [--config.parallel.tensor=2 ...]

Restores the parameters only (not the optimizer state, so it needs about a third of the training
memory) onto a mesh of the current devices: the run's `parallel.*` (with any overrides) when the
devices fit it, else one device; a run dir whose newest step is damaged is read from its newest
intact step, as training resumes (one line says which). Reports the mean next-token loss over N
global batches of the run's held-out split (all of a smaller split, each row once: its last batch
partial, the padding rows masked), or over its first `--eval-tokens` tokens, read as CoLA's
evaluation loop reads them, or of any dataset given with `--config.data.*` overrides, and exp(loss),
in two forms side by side: per target token (the default), and CoLA's reported form (the sum of the
per-batch mean losses over n+1 after n batches, as its code computes it: compare this one with the
paper's tables).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import jax
from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from boost_jax import xla_gpu_flags
from boost_jax.data import build_loaders
from boost_jax.errors import CheckpointError, ConfigError, error_lines
from boost_jax.parallel.mesh import ONE_DEVICE
from boost_jax.runtime.build import Built, build
from boost_jax.runtime.checkpoints.store import read_newest, restore
from boost_jax.runtime.evaluation import eval_loss, plan_eval
from boost_jax.validate import validate


def build_for_eval(cfg, devices=None) -> Built:
    """The run's mesh on these devices if they fit it, else one device (cfg.parallel is updated to match).
    `cfg` is validated (the caller's entry point did)."""
    devices = list(jax.devices() if devices is None else devices)
    try:
        return build(cfg, devices, validated=True)  # `evaluate` validated it
    except ConfigError as e:
        print(f"note: evaluating on one device ({e})", file=sys.stderr)
        cfg.parallel.update(ONE_DEVICE)
        cfg.remat.pipeline = "none"  # stage remat needs stages
        return build(cfg, devices[:1])


def perplexity(
    built: Built, params, *, split: str = "eval", batches: int | None = None, tokens: int | None = None, say=None
) -> dict:
    """Mean next-token loss (and exp of it) over `batches` global batches of a split (all of a
    smaller split, once, said to `say`: default stderr), or over its first `tokens` input tokens that
    are not padding, as CoLA's loop reads them (runtime/evaluation.py)."""
    cfg = built.cfg
    say = say or (lambda text: print(text, file=sys.stderr))
    train_data, eval_data, _ = build_loaders(cfg)  # one process: it feeds the whole batch
    data = eval_data if split == "eval" else train_data
    field = "--eval-tokens" if tokens else "train.eval_tokens"
    reading = plan_eval(
        cfg,
        data,
        batches=batches,
        tokens=tokens,
        split=split,
        tokens_field=field,
        batches_field="--batches" if batches is not None else "train.eval_batches",
    )
    if reading.note:
        say(reading.note)
    result = eval_loss(built, data, params, plan=reading)
    return {
        **result,
        "perplexity": _exp(result["loss"]),
        "cola_perplexity": _exp(result["cola_loss"]),
        "split": split,
        "split_rows": reading.split_rows,
        "batching": cfg.data.batching,
    }


def _exp(loss: float) -> float:
    """exp(loss); a non-finite loss stays itself (exp() would make a number of it: inf caps at exp(50))."""
    return math.exp(min(loss, 50.0)) if math.isfinite(loss) else loss


def evaluate(
    checkpoint: str, overrides=lambda cfg: None, *, split="eval", batches=None, tokens=None, devices=None
) -> dict:
    """Restore a checkpoint's params, apply `overrides(cfg)` (data, batch, mesh) and measure perplexity."""

    def read(cfg, root, step):
        cfg.lock()  # a misspelt override fails instead of adding a key
        overrides(cfg)
        validate(cfg)
        built = build_for_eval(cfg, devices)
        # Parameters only: the optimizer moments stay on disk (a third of the training memory).
        params = restore(
            root,
            {"params": built.spec.abstract["params"]},
            step=step,
            hint="--checkpoint DIR/STEP",
            field="--checkpoint",
        ).state["params"]
        return cfg, root, step, built, params

    # A trainer running with keep-K may rotate the step away while it is read: then the newest one.
    cfg, root, step, built, params = read_newest(checkpoint, read)
    result = perplexity(built, params, split=split, batches=batches, tokens=tokens)
    d = cfg.data
    return {
        "checkpoint": str(root / str(step)),
        "step": step,
        **result,
        "data": {"source": d.source, "path": d.path, "eval_path": d.eval_path},
        "mesh": dict(built.mesh.shape),
        "global_batch": cfg.train.global_batch,
        "seq_len": cfg.train.seq_len,
    }


def check_json_target(path: str) -> None:
    """Fail before any work when --json cannot be written (a directory, or its folder missing)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"--json {path} is a directory; give a file path such as {p / 'eval.json'}")
    parent = p.parent
    if not parent.is_dir():
        raise ConfigError(f"--json {path}: the folder {parent} does not exist; create it or give another path")


def _finite_or_none(x):
    """The result with NaN/inf as null (they are not JSON)."""
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_none(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def main(argv=None) -> int:
    xla_gpu_flags.quiet_gpu_plugin()  # before JAX starts its backends
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="Any other argument must be a --config.KEY=VALUE override."
    )
    ap.add_argument("--checkpoint", required=True, help="run dir, its checkpoints/ dir, or one step dir")
    ap.add_argument("--split", choices=("eval", "train"), default="eval")
    ap.add_argument("--batches", type=int, default=None, help="global batches to average (default train.eval_batches)")
    ap.add_argument(
        "--eval-tokens",
        type=int,
        default=None,
        help="evaluate over whole batches until this many input tokens that are not padding are read "
        "(CoLA: 10000000; default train.eval_tokens, 0: --batches)",
    )
    ap.add_argument("--json", default="", help="also write the result to this JSON file")
    args, rest = ap.parse_known_args(argv)
    if args.batches is not None and args.batches < 1:
        ap.error(f"--batches must be >= 1, got {args.batches}")
    if args.eval_tokens is not None and args.eval_tokens < 0:
        ap.error(f"--eval-tokens must be >= 0, got {args.eval_tokens}")
    bad = [a for a in rest if not a.startswith("--config.")]
    if bad:
        ap.error(f"unrecognized arguments {bad}; overrides look like --config.data.path=/data/val.txt")
    absl_logging.set_verbosity(absl_logging.WARNING)

    def overrides(cfg):
        # absl parses --config.* exactly as the trainer does (types, unknown keys), on private FlagValues.
        fv = flags.FlagValues()
        try:
            config_flags.DEFINE_config_dict("config", cfg, flag_values=fv, sys_argv=["evaluate", *rest])
            fv(["evaluate", *rest])
        except (flags.Error, AttributeError, KeyError) as e:
            why = e
            while isinstance(why, (AttributeError, KeyError)) and why.args:  # unwrap to ml_collections' text
                why = why.args[0]
            why = str(why) if isinstance(e, flags.Error) else "unknown key " + str(why).replace("\n", "; ")
            raise ConfigError(f"overrides {rest}: {why} (the keys are those of boost_jax/config/schema.py)") from e

    try:
        if args.json:
            check_json_target(args.json)
        result = evaluate(args.checkpoint, overrides, split=args.split, batches=args.batches, tokens=args.eval_tokens)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as e:
        print(error_lines(e), file=sys.stderr)
        return 1
    rows = f"{result['rows']} rows, " if "rows" in result else ""
    if result.get("padding_rows"):
        rows = f"{result['rows']} rows (the last batch partial: {result['padding_rows']} padding rows masked), "
    print(
        f"{result['checkpoint']}: {result['split']} loss {result['loss']:.4f}, perplexity "
        f"{result['perplexity']:.2f} per target token ({result['batches']} batches, {rows}{result['tokens']} "
        f"tokens, mesh {result['mesh']}); CoLA's reported form: loss {result['cola_loss']:.4f}, perplexity "
        f"{result['cola_perplexity']:.2f} (the sum of {result['batches']} per-batch means of "
        f"{result['cola_batch_rows']} rows over {result['cola_denominator']}, its code's n+1)"
    )
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(_finite_or_none(result), f, indent=2, allow_nan=False)
        except OSError as e:
            print(
                f"error: --json {args.json}: cannot write the result ({e.strerror or e}); give a writable file path",
                file=sys.stderr,
            )
            return 1
    if result.get("targets") == 0:
        print(
            f"error: the {result['batches']} evaluated batches hold no target (no document is longer than one "
            f"token under data.batching={result['batching']}): there is no loss to measure; evaluate other data",
            file=sys.stderr,
        )
        return 1
    if not math.isfinite(result["loss"]):
        steps = Path(result["checkpoint"]).parent
        print(
            f"error: eval loss is {result['loss']} at step {result['step']}: the checkpoint's weights do not "
            f"compute a finite loss; evaluate an earlier step (--checkpoint {steps}/STEP)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
