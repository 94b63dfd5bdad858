"""The documents say what the repository holds: README's tables equal the JSON files they cite,
and no text narrates work history or cites a file outside the repository."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- what-to-expect:start -->", "<!-- what-to-expect:end -->"
TEXT_SUFFIXES = {".md", ".py", ".h", ".cc", ".ipynb", ".sh", ".toml", ".txt"}


def _tracked_text_files():
  out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
  return [ROOT / p for p in out.stdout.split() if Path(p).suffix in TEXT_SUFFIXES]


def test_readme_tables_equal_the_benchmark_files():
  readme = (ROOT / "README.md").read_text()
  assert START in readme and END in readme, "README.md lost its what-to-expect markers"
  quoted = readme.split(START, 1)[1].split(END, 1)[0].strip()
  printed = subprocess.run([sys.executable, "scripts/readme_table.py"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.strip()
  assert quoted == printed, ("README.md's tables differ from `python scripts/readme_table.py`; "
                             "paste its output between the markers")


def test_no_work_history_and_no_outside_files():
  # Built from parts so that this file does not match itself.
  history = re.compile(r"\b(" + "sess" + r"ions?|" + "iss" + r"ues?) [0-9]+", re.IGNORECASE)
  outside = re.compile(r"\.\./" + "shared|shared/" + "reference|" + r"\b(DESIGN|EVAL)\.md")
  found = []
  for path in _tracked_text_files():
    if not path.exists():
      continue
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
      if history.search(line) or outside.search(line):
        found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
  assert not found, "text that narrates work rounds or cites files outside the repo:\n" + \
      "\n".join(found[:40])
