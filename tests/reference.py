"""Where the golden values live: `tests/data/reference/`, produced by transformers and llama.cpp
(its README says which versions and how). A missing file is an error, not a skip: the data ships
with the repository, so a test that cannot read it has found a broken checkout."""

import json
from pathlib import Path

import numpy as np

REFERENCE_DIR = Path(__file__).resolve().parent / "data" / "reference"


def load(name: str):
  """One reference file by name: a `.json` as a dict, a `.npy` as an array."""
  path = REFERENCE_DIR / name
  if path.suffix == ".npy":
    return np.load(path)
  return json.loads(path.read_text())
