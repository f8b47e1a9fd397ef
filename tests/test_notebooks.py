"""Every notebook in notebooks/ runs top to bottom (in its small configuration) without errors."""
import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "notebooks", "*.ipynb")))


def test_notebooks_exist():
  assert NOTEBOOKS, "no notebooks found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path, monkeypatch):
  nb = nbformat.read(path, as_version=4)
  monkeypatch.setenv("MPLBACKEND", "Agg")  # the kernel inherits it; %matplotlib inline still renders
  client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
  assert not errors
