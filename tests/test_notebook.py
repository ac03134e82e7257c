"""colab/quickstart.ipynb runs top to bottom headlessly and samples text."""
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs nbformat: pip install -e '.[test]'")
nbclient = pytest.importorskip("nbclient", reason="needs nbclient: pip install -e '.[test]'")
pytest.importorskip("ipykernel", reason="needs ipykernel (the python3 kernel): pip install -e '.[test]'")
pytest.importorskip("matplotlib", reason="needs matplotlib: pip install -e '.[test]'")

NOTEBOOK = Path(__file__).resolve().parents[1] / "colab" / "quickstart.ipynb"


def test_quickstart_notebook_runs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Raises CellExecutionError, naming the cell, if any cell errors. The kernel inherits this
    # process's environment (conftest's 8-device XLA_FLAGS), which the notebook also sets itself.
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    (sample,) = [c for c in nb.cells if "sample" in c.metadata.get("tags", [])]
    text = "".join(o.get("text", "") for o in sample.outputs if o.output_type == "stream" and o.name == "stdout")
    assert text.startswith("def ") and len(text.strip()) > 20, sample.outputs
