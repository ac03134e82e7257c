"""The Colab notebooks run top to bottom headlessly, from a working directory that is not colab/ (as
on Colab, /content): quickstart.ipynb samples text; gpu_tour.ipynb runs on CPU with tiny sizes put in
place of its parameters cell. Their setup cell names the repository the README's badges open."""
import re
from pathlib import Path

import pytest

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


def test_setup_cells_name_the_readmes_repository():
    readme = (NOTEBOOK.parents[1] / "README.md").read_text()
    for path in (NOTEBOOK, TOUR):
        (setup,) = [c for c in nbformat.read(path, as_version=4).cells if "setup" in c.metadata.get("tags", [])]
        (url,) = re.findall(r'^REPO_URL = "https://github\.com/([^"]+)"$', setup.source, flags=re.M)
        badge = f"https://colab.research.google.com/github/{url}/blob/main/colab/{path.name}"
        assert badge in readme, f"README has no Open in Colab badge for {path.name} at {badge}"
        assert '"git", "clone"' in setup.source and '"[gpu]"' in setup.source


@pytest.mark.slow  # ~1.5 min: the whole notebook, training included
def test_quickstart_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Raises CellExecutionError, naming the cell, if any cell errors. The kernel inherits this
    # process's environment (conftest's 8-device XLA_FLAGS), which the notebook also sets itself.
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    (sample,) = [c for c in nb.cells if "sample" in c.metadata.get("tags", [])]
    text = "".join(o.get("text", "") for o in sample.outputs if o.output_type == "stream" and o.name == "stdout")
    assert text.startswith("def ") and len(text.strip()) > 20, sample.outputs


def test_gpu_tour_runs_on_cpu_with_tiny_sizes(tmp_path):
    nb = nbformat.read(TOUR, as_version=4)
    (params,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    params.source = TINY  # every name the GPU sizes set, tiny
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                     if o.output_type == "stream")
    assert "llama_60m" in text and "cola_60m" in text  # both runs' summary rows
    assert "cudnn    failed:" in text  # on CPU: its row says why, the others are timed
    (comm,) = [c for c in nb.cells if "comm" in c.metadata.get("tags", [])]
    lines = [o["text"] for o in comm.outputs if o.output_type == "stream"]
    assert all(name in "".join(lines) for name in ("btp", "vanilla", "megatron"))
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 3  # loss / tokens/s / MFU, the attention timings, the traffic chart
