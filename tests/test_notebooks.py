"""The notebooks' structure (their execution is pytest --nbmake over notebooks/): Colab-only cells
are tagged so CI skips them, the executed cells use only pigjax's public modules, and the README's
"Open in Colab" badges point at notebooks that exist."""

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
COLAB_ONLY = re.compile(r"^\s*!|google\.colab", re.M)


def _code_cells(path):
  return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def test_colab_only_cells_are_skipped_in_ci():
  assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "magicpig_long_context.ipynb"}
  for path in NOTEBOOKS:
    colab = [c for c in _code_cells(path) if COLAB_ONLY.search("".join(c["source"]))]
    assert colab, f"{path.name} has no install cell"
    for cell in colab:
      assert "skip-execution" in cell["metadata"].get("tags", []), (path.name, cell["source"])


def test_executed_cells_import_only_public_pigjax():
  private = re.compile(r"from pigjax\.(?:_\w+|serving\.\w+|engine) import|pigjax\._")
  for path in NOTEBOOKS:
    for cell in _code_cells(path):
      assert not private.search("".join(cell["source"])), (path.name, cell["source"])


def test_readme_badges_open_the_notebooks_in_colab():
  readme = (REPO / "README.md").read_text()
  linked = re.findall(r"colab\.research\.google\.com/github/[^/\s]+/[^/\s]+/blob/main/"
                      r"notebooks/([\w.]+\.ipynb)", readme)
  assert sorted(linked) == sorted(p.name for p in NOTEBOOKS)
