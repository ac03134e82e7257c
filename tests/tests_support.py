"""Helpers shared by tests."""

import json
from pathlib import Path

from boost_jax.runtime.build import build
from boost_jax.tools.hlo_comm import compile_partitioned


def metric_rows(run_dir, key="loss"):
    """{step: value} of one metric from a run's metrics.jsonl."""
    rows = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    return {r["step"]: r[key] for r in rows if key in r}


def compiled_step(cfg, partitioned=False):
    """(compiled step, the build, partitioned HLO or None): the trainer's jitted train step (the
    runtime's builder), compiled once (with `partitioned`, the same compile also yields the HLO after
    SPMD partitioning, whose collectives carry their logical dtypes; XLA:CPU later widens bf16
    collectives to float32)."""
    built = build(cfg)
    lowered = built.lower_train()
    compiled, text = compile_partitioned(lowered) if partitioned else (lowered.compile(), None)
    return compiled, built, text


def fresh_venv(where, env: dict):
    """A new virtual environment at `where` (its python returned) that sees the packages installed for
    this interpreter, whether it runs in a virtual environment or not (`venv --system-site-packages`
    sees the base interpreter's packages: from inside a venv, not the venv's own). A .pth file puts
    this interpreter's site-packages directories after the new environment's own, so that what is
    installed into it comes first; their .pth files are not run, so an editable boost_jax installed
    there stays out of sight."""
    import site
    import subprocess
    import sys

    where = Path(where)
    subprocess.run([sys.executable, "-m", "venv", str(where)], env=env, check=True, capture_output=True)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = [p for p in (*site.getsitepackages(), site.getusersitepackages()) if Path(p).is_dir()]
    (Path(purelib) / "outer_site_packages.pth").write_text("".join(f"{p}\n" for p in ours))
    return python
