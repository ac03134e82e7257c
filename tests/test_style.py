"""The code has one style (pyproject.toml [tool.ruff]): `ruff format --check` finds nothing to lay out
again and `ruff check` finds no error, unused name or unsorted import."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args, cwd=ROOT):
    exe = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_tree_is_formatted():
    r = ruff("format", "--check", ".")
    assert r.returncode == 0, "run `ruff format .`:\n" + r.stdout[-3000:] + r.stderr[-2000:]


def test_the_linter_finds_nothing():
    r = ruff("check", ".")
    assert r.returncode == 0, "run `ruff check --fix .`:\n" + r.stdout[-4000:] + r.stderr[-2000:]


def test_the_check_can_fail(tmp_path):
    """A copy of one module with an unused import and an unsorted import block fails both checks."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "bad.py").write_text("import sys\nimport os\n\nx = {'a':1}\n")
    assert ruff("check", ".", cwd=tmp_path).returncode != 0
    assert ruff("format", "--check", ".", cwd=tmp_path).returncode != 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
