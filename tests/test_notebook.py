"""The Colab notebooks run top to bottom headlessly, from a working directory that is not colab/ (as
on Colab, /content): quickstart.ipynb samples text; gpu_tour.ipynb runs on CPU with tiny sizes put in
place of its parameters cell. Their setup cell starts from nothing as on a fresh Colab runtime: in a
new virtual environment without boost_jax, from a directory that is no checkout, it installs
boost_jax from the git URL or the wheel its SOURCE form field names."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests_support import fresh_venv

nbformat = pytest.importorskip("nbformat", reason="needs nbformat: pip install -e '.[test]'")
nbclient = pytest.importorskip("nbclient", reason="needs nbclient: pip install -e '.[test]'")
pytest.importorskip("ipykernel", reason="needs ipykernel (the python3 kernel): pip install -e '.[test]'")
pytest.importorskip("matplotlib", reason="needs matplotlib: pip install -e '.[test]'")

NOTEBOOK = Path(__file__).resolve().parents[1] / "colab" / "quickstart.ipynb"
TOUR = NOTEBOOK.with_name("gpu_tour.ipynb")
# In place of the tour's GPU sizes: a 2-layer d=32 model for 6 steps, tiny attention, the tiny config's traffic.
TINY = """
SIZE = "60m"
MODEL_OVERRIDES = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=64, rank=8)
STEPS = 6
SEQ_LEN, BATCH = 16, 8
LOG_EVERY = 2
ATTENTION_SHAPE = (1, 32, 2, 16)
TIMED_CALLS = 1
COMM_CONFIG = "tiny"
COMM_SEQ = 32
"""


FORM_FIELD = 'SOURCE = ""  #@param {type:"string"}'


def setup_cell(path) -> str:
    (setup,) = [c for c in nbformat.read(path, as_version=4).cells if "setup" in c.metadata.get("tags", [])]
    return setup.source


def test_setup_cells_are_one_form_with_nothing_to_replace():
    """Both notebooks' setup cells are the same code, whose only input is a Colab form field that
    defaults to what works without a URL (no placeholder repository); the README says how to fill it."""
    readme = (NOTEBOOK.parents[1] / "docs" / "export.md").read_text()  # the page that says how
    cells = [setup_cell(path) for path in (NOTEBOOK, TOUR)]
    assert cells[0] == cells[1] and cells[0].count(FORM_FIELD) == 1 and "#@title" in cells[0]
    assert "OWNER" not in cells[0] and "OWNER" not in readme and "github.com/" not in cells[0]
    assert "SOURCE" in readme and "pip wheel --no-deps -w dist ." in readme


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A bare clone of this checkout (what a git URL gives the cell) and a wheel built from it."""
    if subprocess.run(["git", "-C", str(NOTEBOOK.parents[1]), "rev-parse"], capture_output=True).returncode:
        pytest.skip("needs this checkout to be a git repository")
    tmp = tmp_path_factory.mktemp("sources")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run(
        ["git", "clone", "-q", "--bare", str(NOTEBOOK.parents[1]), str(tmp / "boost_jax.git")], check=True, env=env
    )
    subprocess.run(["git", "clone", "-q", str(tmp / "boost_jax.git"), str(tmp / "src")], check=True, env=env)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"), str(tmp / "src")],
        check=True,
        env=env,
        capture_output=True,
    )
    return {"clone": (tmp / "boost_jax.git").as_uri(), "wheel": str(next((tmp / "dist").glob("boost_jax-*.whl")))}


@pytest.mark.slow  # ~1.5 min: a wheel built, two virtual environments, a clone installed editable
@pytest.mark.parametrize("kind", ["clone", "wheel"])
def test_setup_cell_starts_from_nothing(kind, sources, tmp_path):
    """The quickstart's setup cell, SOURCE set in its form field to a local clone URL or a wheel, run
    in a fresh virtual environment without boost_jax from a directory that is no checkout (Colab's
    /content): boost_jax is then importable in that same process, from the clone or the wheel."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    python = fresh_venv(tmp_path / "venv", env)
    work = tmp_path / "content"
    work.mkdir()
    probe = "import importlib.util; print(importlib.util.find_spec('boost_jax'))"
    assert (
        subprocess.run([str(python), "-c", probe], cwd=work, env=env, capture_output=True, text=True).stdout.strip()
        == "None"
    )  # nothing to start from
    cell = setup_cell(NOTEBOOK).replace(FORM_FIELD, f"SOURCE = {sources[kind]!r}")
    out = subprocess.run(
        [str(python), "-c", cell + "\nprint('FILE', boost_jax.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    where = Path(out.stdout.split("FILE ")[-1].strip())
    if kind == "clone":
        assert where == work / "boost_jax_src" / "boost_jax" / "__init__.py", out.stdout
    else:
        assert where.is_relative_to(tmp_path / "venv") and not (work / "boost_jax_src").exists(), out.stdout
    assert "boost_jax from" in out.stdout


@pytest.mark.slow  # ~1.5 min: the whole notebook, training included
def test_quickstart_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Raises CellExecutionError, naming the cell, if any cell errors. The kernel inherits this
    # process's environment (conftest's 8-device XLA_FLAGS), which the notebook also sets itself.
    nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    (sample,) = [c for c in nb.cells if "sample" in c.metadata.get("tags", [])]
    text = "".join(o.get("text", "") for o in sample.outputs if o.output_type == "stream" and o.name == "stdout")
    assert text.startswith("def ") and len(text.strip()) > 20, sample.outputs


def test_gpu_tour_runs_on_cpu_with_tiny_sizes(tmp_path):
    nb = nbformat.read(TOUR, as_version=4)
    (params,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    params.source = TINY  # every name the GPU sizes set, tiny
    nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    text = "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "stream"
    )
    assert "llama_60m" in text and "cola_60m" in text  # both runs' summary rows
    assert "cudnn    failed:" in text  # on CPU: its row says why, the others are timed
    (comm,) = [c for c in nb.cells if "comm" in c.metadata.get("tags", [])]
    lines = [o["text"] for o in comm.outputs if o.output_type == "stream"]
    assert all(name in "".join(lines) for name in ("btp", "vanilla", "megatron"))
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 3  # loss / tokens/s / MFU, the attention timings, the traffic chart
