"""The layers are a contract (pyproject.toml [tool.importlinter]): errors and the config schema at
the bottom, kernels, then parallel and data, the model, validation, the runtime, tools, the
planner, and the entry points on top; no import cycles inside any package. `lint-imports` checks
every import statement (function-level ones included)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def lint(cwd=ROOT):
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    return subprocess.run([exe], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_layer_contracts_hold():
    r = lint()
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "2 kept, 0 broken" in r.stdout, r.stdout[-2000:]


def test_an_upward_import_breaks_the_contract(tmp_path):
    """The check can fail: a copy of the package whose parallel layer imports the model."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "boost_jax", copy / "boost_jax", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    mesh = copy / "boost_jax" / "parallel" / "mesh.py"
    mesh.write_text(mesh.read_text() + "\n\ndef _up():\n    from boost_jax.model import kinds  # noqa: F401\n")
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, '.');"
            "from importlinter.cli import lint_imports_command; lint_imports_command()",
        ],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0 and "BROKEN" in r.stdout, r.stdout[-3000:]
    assert "boost_jax.parallel.mesh -> boost_jax.model.kinds" in r.stdout, r.stdout[-3000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
