"""Writes docs/configuration.md from pigjax/config.py (fields) and tools/config_docs.py (the
environment variables):

    python scripts/gen_config_docs.py

tests/test_config_docs.py fails when the file differs from what this writes.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools import config_docs  # noqa: E402

OUT = ROOT / "docs" / "configuration.md"

if __name__ == "__main__":
  OUT.write_text(config_docs.markdown_reference())
  print(f"wrote {OUT.relative_to(ROOT)}")
