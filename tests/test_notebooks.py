"""Every notebook in notebooks/ runs top to bottom (in its small configuration) without errors."""
import glob
import os

import pytest

# The notebook runners are in the `test` extra; a GPU machine running `make gpu-test` may not have them.
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

pytestmark = pytest.mark.slow  # a quarter of the CPU suite's time: `make test-fast` leaves them out

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "notebooks", "*.ipynb")))

# CI settings for the test run, set in a cell inserted right after the cell that defines them: every cell still
# runs, on the same grid and the same compiled programs (training, checkpoint round trip, encode / decode, prior
# sampling, plots). Only three things are cheaper. The loops repeat their step fewer times (each step runs the
# program the first one compiled, a VAE step ~1.7 s on a CPU; the progress lines still print: 6 and 5 steps). The
# training set has 256 shapes instead of 1024: 16 batches, more than the 6 VAE steps read, so each step still
# trains on a batch of its own, and the prior's data (every training batch encoded, one call of the same compiled
# encoder each, ~0.6 s on a CPU) shrinks to 256 coarse grids, still twice the prior's batch of 128. The plots render
# the shapes pooled to 8^3 instead of 16^3 (plot_grid's max_resolution: the same panels, the same calls, a few
# hundred voxel faces each instead of thousands, which matplotlib draws one polygon at a time). The test checks
# that the notebook runs, not how well it trains nor how fine its figures are (README's figures come from the full
# small configuration, ~4 min on a CPU). JSPARSE_FULL_NOTEBOOKS=1 runs the notebooks unchanged.
SHORT_TRAINING = {
    "02_generation.ipynb": ("VAE_STEPS, PRIOR_STEPS, PRIOR_BATCH, KL_WEIGHT = ",
                            "VAE_STEPS, PRIOR_STEPS = 6, 50    # tests/test_notebooks.py: shorter training\n"
                            "NUM_SHAPES = 256                  # on fewer shapes (16 batches of 16)\n"
                            "PLOT_RES = 8                      # and coarser renders"),
}


def _shorten_training(nb, name):
  if name not in SHORT_TRAINING or os.environ.get("JSPARSE_FULL_NOTEBOOKS"):
    return
  defined_by, override = SHORT_TRAINING[name]
  where = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and defined_by in c.source]
  assert where, f"{name}: no cell defines {defined_by!r}; update SHORT_TRAINING"
  nb.cells.insert(where[0] + 1, nbformat.v4.new_code_cell(override))


def test_notebooks_exist():
  assert NOTEBOOKS, "no notebooks found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path, monkeypatch):
  nb = nbformat.read(path, as_version=4)
  _shorten_training(nb, os.path.basename(path))
  monkeypatch.setenv("MPLBACKEND", "Agg")  # the kernel inherits it; %matplotlib inline still renders
  client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
  assert not errors
