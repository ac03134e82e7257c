"""Follow the config through a training run: which project functions receive it, in which files.

Runs `train.run` on a small model for two steps with a profiler hook and records every call of a
project function that takes a config (the run's, one of its sections such as `cfg.model`, or a copy)
as an argument. Reported:

- files: the distinct project files those functions live in (how far a reader follows `cfg`);
- returns: how often the walk enters a file it had already left (the reader goes back);
- stays: consecutive calls in the same file.

    python benchmarks/cfg_walk.py [--mesh] [--json benchmarks/cfg_walk.json]

`--mesh` runs it on 8 emulated devices, pipeline 2 x tensor 2 x data 2 (1F1B, four micro-batches), so
the parallel paths are walked too.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--mesh" in sys.argv:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ml_collections  # noqa: E402

from boost_jax import train  # noqa: E402
from boost_jax.config import base_config  # noqa: E402


def small_config(run_dir: str, mesh: bool = False):
    c = base_config()
    c.run_dir = run_dir
    c.model.update(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, rank=8, max_seq_len=32)
    c.train.update(seq_len=16, global_batch=8, steps=2, warmup_steps=1, log_every=1, eval_every=2, progress=False)
    c.train.eval_batches = 1
    c.checkpoint.update(every=2, async_save=False)
    c.data.embedded_max_bytes = 200_000
    if mesh:
        c.parallel.update(pipeline=2, tensor=2, data=2, pipeline_schedule="1f1b", microbatches=4)
    return c


def walk(cfg) -> list[tuple[str, str]]:
    """(file, function) of every project call that receives a config: the one given, a section of it,
    or a copy (the builder resolves `auto` fields on a copy)."""
    package = str(ROOT / "boost_jax")
    calls = []

    def hook(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(package):
            return
        n = code.co_argcount + code.co_kwonlyargcount
        names = code.co_varnames[:n]
        if any(isinstance(frame.f_locals.get(a), ml_collections.ConfigDict) for a in names):
            calls.append((os.path.relpath(code.co_filename, ROOT), code.co_name))

    sys.setprofile(hook)
    try:
        train.run(cfg)
    finally:
        sys.setprofile(None)
    return calls


def summarize(calls) -> dict:
    files, seen, returns, stays, last = [], set(), 0, 0, None
    for f, _ in calls:
        if f == last:
            stays += 1
            continue
        if f in seen:
            returns += 1
        else:
            files.append(f)
            seen.add(f)
        last = f
    return {"files": len(files), "returns": returns, "stays": stays, "calls": len(calls), "file_order": files}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", action="store_true", help="8 emulated devices: pipeline 2 x tensor 2 x data 2")
    p.add_argument("--json", default="", help="write the summary and the call list here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        calls = walk(small_config(d, args.mesh))
    s = summarize(calls)
    print(f"files {s['files']}  returns {s['returns']}  stays {s['stays']}  calls {s['calls']}")
    for i, f in enumerate(s["file_order"], 1):
        print(f"{i:3d} {f}")
    if args.json:
        Path(args.json).write_text(json.dumps({**s, "call_list": calls}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
