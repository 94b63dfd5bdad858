"""Fetches the quality harness's real text (Debian packages) into a git-ignored cache.

    python scripts/fetch_data.py [--out data/text] [--packages debian-handbook,python3.11-doc]

Runs `apt-get download` + `dpkg-deb -x` (run `apt-get update` once if the download fails) and
writes one plain-text file per document. The data is never committed (data/ is git-ignored).
"""

from absl import app, flags

from pigjax.eval import data

_OUT = flags.DEFINE_string("out", str(data.DEFAULT_DIR), "Cache directory.")
_PACKAGES = flags.DEFINE_list("packages", list(data.PACKAGES), "Debian packages to fetch.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  files = data.fetch(_OUT.value, _PACKAGES.value)
  chars = sum(f.stat().st_size for f in files)
  print(f"{len(files)} documents, {chars / 1e6:.1f} MB of text under {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
