"""Long benchmark contexts stitched from many different real documents.

Prefilling 128k tokens of a real model on two CPU cores would take hours, and repeating one 2k
source (`bench.tile_cache`) makes near-duplicate keys collide, so MagicPIG attends 4-10% of the
pool there against 3-4% on real text (QUALITY.md). Here a long context is made of pieces of
`piece_tokens` tokens, each the start of a different real document (Debian handbook chapters and
Python documentation pages, `pigjax.eval.data`), each prefilled densely on its own from position
0 and re-rotated to its offset in the long context: RoPE rotations compose, so rotating a key by
(offset - position in its piece) is exactly "un-rotate, rotate at the new position" (as in
`bench.tile_cache`). The first piece is kept whole; later pieces drop their first `sink` tokens,
which a prefill from position 0 turns into attention sinks that a real long document has once.

Each piece's prefilled K/V is cached on disk (float16, one .npy per piece, memory-mapped while
stitching) under data/bench_pieces/, keyed by the model and the token ids, so reruns skip the
prefill (about 12 s per 2k piece on two cores).

Shape key: B batch   K kv heads   S cache positions   D head dim   N context tokens   L layers
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np

from pigjax import attention
from pigjax.config import ModelConfig
from pigjax.engine import Engine
from pigjax.eval import data
from tools import bench

DEFAULT_CACHE_DIR = data.DEFAULT_DIR.parent / "bench_pieces"


def pieces_needed(n: int, piece_tokens: int, sink: int) -> int:
  """Pieces that make an n-token context: the first whole, each later one minus its sink."""
  if n <= piece_tokens:
    return 1
  return 1 + -(-(n - piece_tokens) // (piece_tokens - sink))


def stitch_positions(piece_tokens: int, n: int, sink: int) -> tuple[np.ndarray, np.ndarray]:
  """For context positions p < n: the index of its source token in the concatenated pieces
  ([num_pieces * piece_tokens]) and that token's position inside its piece."""
  p = np.arange(n)
  rest = np.maximum(p - piece_tokens, 0)
  later = p >= piece_tokens
  piece = np.where(later, 1 + rest // (piece_tokens - sink), 0)
  pos = np.where(later, sink + rest % (piece_tokens - sink), p)
  return (piece * piece_tokens + pos).astype(np.int32), pos.astype(np.int32)


def document_pieces(encode: Callable[[str], list[int]], num_pieces: int, piece_tokens: int,
                    data_dir: Path = data.DEFAULT_DIR, seed: int = 0) -> list[list[int]]:
  """num_pieces runs of piece_tokens token ids: the first piece_tokens of as many different
  documents as there are (in a seeded order); only when those run out, a document's next run.

  Raises ValueError (saying to run scripts/fetch_data.py) if the text is too short.
  """
  docs = data.load_documents(data_dir)
  order = np.random.default_rng(seed).permutation(len(docs))
  tokens: dict[int, list[int]] = {}
  pieces: list[list[int]] = []
  for r in range(10**6):
    grew = False
    for i in order:
      if len(pieces) == num_pieces:
        return pieces
      if i not in tokens:
        tokens[i] = encode(docs[i])
      if len(tokens[i]) >= (r + 1) * piece_tokens:
        pieces.append(tokens[i][r * piece_tokens:(r + 1) * piece_tokens])
        grew = True
    if not grew:
      break
  raise ValueError(f"The text under {data_dir} gives only {len(pieces)} pieces of "
                   f"{piece_tokens} tokens, {num_pieces} needed; run scripts/fetch_data.py.")


def _piece_path(engine: Engine, ids: list[int], cache_dir: Path) -> Path:
  h = hashlib.sha1()
  h.update(repr((engine.cfg.checkpoint, engine.cfg.dtype, engine.cfg.model)).encode())
  h.update(np.asarray(ids, np.int32).tobytes())
  return Path(cache_dir) / f"{h.hexdigest()[:20]}.npy"


def piece_kv(engine: Engine, ids: list[int], cache_dir: Path = DEFAULT_CACHE_DIR,
             log: Callable[[str], None] | None = None) -> np.ndarray:
  """The dense prefill's keys and values of one piece, [2, L, K, T, D] float16 (memory-mapped
  from the disk cache; prefilled and written there on a miss)."""
  path = _piece_path(engine, ids, cache_dir)
  if not path.exists():
    t0 = time.perf_counter()
    cache, _ = bench.real_prefill(engine, ids)
    t = len(ids)
    kv = np.stack([np.stack([np.asarray(x[0, :, :t], np.float16) for x in xs])
                   for xs in (cache.k, cache.v)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
    np.save(tmp, kv)
    os.replace(tmp, path)
    if log:
      log(f"prefilled a {t}-token piece in {time.perf_counter() - t0:.1f} s -> {path}")
  return np.load(path, mmap_mode="r")


def stitched_cache(pieces: list[np.ndarray], n: int, capacity: int, model_cfg: ModelConfig,
                   sink: int = 4, dtype=jnp.float32) -> attention.DenseCache:
  """A one-row dense cache of n tokens (capacity positions) from `piece_kv` arrays, in order."""
  piece_tokens = pieces[0].shape[3]
  used = pieces_needed(n, piece_tokens, sink)
  if used > len(pieces):
    raise ValueError(f"A {n}-token context needs {used} pieces of {piece_tokens}; got "
                     f"{len(pieces)}.")
  src_N, pos_N = stitch_positions(piece_tokens, n, sink)
  delta_N = jnp.asarray(np.arange(n, dtype=np.int32) - pos_N)
  src_N = jnp.asarray(src_N)
  k, v = [], []
  for layer in range(pieces[0].shape[1]):
    # [1, K, used * T, D] of this layer only: all layers at once would not fit at 128k.
    k_src, v_src = (jnp.asarray(np.concatenate([p[i, layer] for p in pieces[:used]], axis=1)
                                [None].astype(np.float32)) for i in (0, 1))
    kt, vt = bench._tile_layer(k_src, v_src, src_N, delta_N, capacity=capacity,
                               model_cfg=model_cfg, dtype=jnp.dtype(dtype))
    k.append(kt), v.append(vt)
  return attention.DenseCache(k=tuple(k), v=tuple(v), lengths_B=jnp.full((1,), n, jnp.int32))
