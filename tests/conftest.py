"""Emulate an 8-device cluster on the CPU (XLA_FLAGS must be set before jax is imported), and make
the suite's compiles cheap: compiling is most of its time.

- LLVM's optimisation level 0 for XLA:CPU's generated code (`--xla_backend_optimization_level=0`):
  a third less compile time; and with jaxlib 0.10, XLA:CPU's older fusion code generators
  (`--xla_cpu_use_fusion_emitters=false`): about half the rest, and one LLVM module per program
  (`--xla_cpu_parallel_codegen_split_count=1`: on small programs, splitting the module for parallel
  codegen costs more CPU than it saves; benchmarks/RESULTS.md, "the suite's time"). SPMD
  partitioning and the collectives (what most tests read) are unchanged, temp buffer sizes may
  move slightly; results may differ from the default build in the last bits, so the one test of
  recorded bits, tests/test_golden.py, runs with the default flags. BOOST_TEST_XLA_OPT=default keeps the defaults.
- A persistent compilation cache under the user's cache directory: the suite compiles many identical
  programs (in many tests, worker processes and the trainers they start), and a rerun compiles next
  to nothing. BOOST_TEST_COMPILE_CACHE=0 turns it off; =DIR puts it elsewhere.
The variables reach the subprocesses the tests start."""

import importlib.metadata
import os
from pathlib import Path

FAST_COMPILE = "--xla_backend_optimization_level=0"
# XLA aborts on a flag it does not know: this one is named only for the jaxlib it was checked with.
if importlib.metadata.version("jaxlib").startswith("0.10."):
    FAST_COMPILE += " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + ("" if os.environ.get("BOOST_TEST_XLA_OPT") == "default" else " " + FAST_COMPILE)
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_CACHE = os.environ.get("BOOST_TEST_COMPILE_CACHE", "")
if _CACHE != "0":
    _CACHE = _CACHE or str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "boost_jax" / "jax_cache")
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import pytest  # noqa: E402

from boost_jax.config import base_config  # noqa: E402


def small_config(run_dir, **overrides):
    """A model small enough to compile in seconds; overrides use dotted keys."""
    c = base_config()
    c.run_dir = str(run_dir)
    c.model.update(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, rank=8, max_seq_len=32)
    c.train.update(
        seq_len=16, global_batch=8, steps=8, warmup_steps=2, log_every=2, eval_every=4, eval_batches=2, progress=False
    )
    c.checkpoint.update(every=4, async_save=False)
    c.data.embedded_max_bytes = 200_000
    for key, value in overrides.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the markers into group suffixes
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (`--dist loadgroup`), tests sharing an expensive module- or session-scoped
    fixture run on one worker, so the fixture is built once; the rest spread over the workers."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        shared = sorted(
            name
            for name, defs in (info.name2fixturedefs.items() if info else ())
            if defs and defs[-1].scope in ("module", "session") and name != "tmp_path_factory"
        )
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}.{shared[0]}"))


@pytest.fixture
def make_config(tmp_path):
    def make(**kw):
        return small_config(kw.pop("run_dir", tmp_path / "run"), **kw)

    return make
