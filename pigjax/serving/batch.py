"""The device side of continuous batching: a running cache of fixed `slots` rows and the compiled
programs that prefill one request, put it into a row, and step every row at once.

All programs are compiled once per shape and reused across requests: the running batch always has
`slots` rows and `cache_len` positions, prefill chunks are bucketed (powers of two up to
`prefill_chunk`), and each row's sampling parameters are [B] operands (`sampling.RowSampling`), so
admitting a request with new settings never recompiles. The one static switch: a plain-greedy
program while every row is greedy without penalty, the full sampler otherwise (two programs; a
greedy row gets the same token from both).

The model pieces are `pigjax.engine.Engine`'s (`_prefill_chunk`, `_decode_logits`,
`_hidden_logits`, its compile cache); this module only adds per-row sampling and row insertion.

Shape key: B rows (slots)   T prompt tokens in a chunk   S cache positions   E hidden size
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pigjax import attention, sampling, sharding
from pigjax.config import Config
from pigjax.engine import Engine, _bucket, kv_cache_dtype
from pigjax.model import Llama
from pigjax.serving.rows import make_row_backend


@dataclasses.dataclass
class Prefill:
  """A request being prefilled alone (batch 1), one chunk per scheduler step."""
  prompt_ids: list[int]
  cache: attention.DenseCache
  last_hidden_1E: jax.Array
  step_len: int
  done_tokens: int = 0

  @property
  def finished(self) -> bool:
    return self.done_tokens >= len(self.prompt_ids)


def needs_full_sampler(rows: Sequence[Any]) -> bool:
  """Whether some row samples or penalises repeats (else plain argmax serves every row)."""
  return any(r.temperature > 0 or r.repetition_penalty != 1.0 for r in rows)


class SlotBatch:
  """A fixed number of decode rows over one model.

  Args:
    cfg: the config (attention kind, prefill chunk, dtype).
    model: the loaded Llama (shared with a `Pipeline`'s engine; weights are not copied).
    slots: rows decoded together.
    cache_len: positions per row (prompt + generated tokens).
  """

  def __init__(self, cfg: Config, model: Llama, slots: int, cache_len: int):
    if slots < 1:
      raise ValueError(f"serve.slots must be >= 1, got {slots}.")
    if sharding.mesh_requested(cfg.mesh):
      raise ValueError("Serving runs on one device in one process for now; leave mesh.data and "
                       "mesh.model at 1 and start it without jax.distributed.")
    self.cfg = cfg
    self.slots = slots
    self.cache_len = cache_len
    self.backend = make_row_backend(cfg)
    self.engine = Engine(cfg, model, self.backend)
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      self.cache_dtype = kv_cache_dtype(cfg, model.dtype)
      self.cache = self.backend.init_running(slots, cache_len, self.cache_dtype)
    self.hidden = cfg.model.hidden_size
    self.dtype = model.dtype

  @property
  def params(self):
    return self.engine.params

  # -- prefill ------------------------------------------------------------------------------

  def start_prefill(self, prompt_ids: Sequence[int]) -> Prefill:
    step_len = min(self.cfg.prefill_chunk, _bucket(len(prompt_ids), 32))
    m = self.cfg.model
    cache = attention.DenseCache.create(m.num_layers, 1, m.num_kv_heads, self.cache_len,
                                        m.head_dim, self.cache_dtype)
    return Prefill(list(prompt_ids), cache, jnp.zeros((1, self.hidden), self.dtype), step_len)

  def prefill_chunk(self, p: Prefill) -> None:
    """Runs the next chunk of `p`'s prompt."""
    s, T = p.done_tokens, p.step_len
    chunk = p.prompt_ids[s:s + T]
    tokens_1T = np.zeros((1, T), np.int32)
    tokens_1T[0, :len(chunk)] = chunk
    args = (self.params, p.cache, jnp.asarray(tokens_1T), jnp.asarray([len(chunk)], jnp.int32),
            p.last_hidden_1E)
    run = self.engine._compile("prefill", self.engine._prefill_chunk, (), (1,), *args)
    p.cache, p.last_hidden_1E = run(*args)
    p.done_tokens += len(chunk)

  def admit(self, p: Prefill, slot: int, row: Any, seed: int, history_S: np.ndarray) -> int:
    """Puts a finished prefill into row `slot` and samples the request's first token.

    Args:
      row: the request's sampling settings (temperature, top_k, top_p, min_p,
        repetition_penalty attributes).
      seed: the request's seed.
      history_S: int32 prompt ids, -1 padded to cache_len (for the repetition penalty).
    Returns:
      the first generated token id.
    """
    assert p.finished
    # The row's settings as [1] operands first: a value they cannot hold fails here, before
    # the running cache is touched.
    rows = sampling.RowSampling.from_rows([row])
    full = needs_full_sampler([row])
    self.free(slot)
    args = (self.cache, p.cache, jnp.int32(slot))
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      insert = self.engine._compile("insert_row", self.backend.insert_row, (), (0,), *args)
      self.cache = insert(*args)
    args = (self.params, p.last_hidden_1E, jnp.asarray([seed], jnp.int32),
            jnp.zeros((1,), jnp.int32), rows,
            jnp.asarray(history_S[None] if full else np.zeros((1, 1), np.int32)))
    first = self.engine._compile(
        "first_rows", functools.partial(self._first_rows, full=full), (full,), (), *args)
    return int(first(*args)[0])

  def _first_rows(self, params, last_hidden_BE, seeds_B, counters_B, rows, history_BS, *, full):
    logits_BV = self.engine._hidden_logits(params, last_hidden_BE)
    return sampling.sample_rows(logits_BV, sampling.row_keys(seeds_B, counters_B), rows,
                                penalize=full, stochastic=full, prev_tokens_BT=history_BS)

  # -- decode -------------------------------------------------------------------------------

  def reset(self) -> None:
    """A fresh, empty running cache (every row free), after a failed step whose donated
    buffers may be gone. The compiled programs are kept: the shapes are unchanged."""
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      self.cache = self.backend.init_running(self.slots, self.cache_len, self.cache_dtype)

  def free(self, slot: int) -> None:
    """Releases a row's host resources (its host-store slot) once dispatched work is done."""
    self.sync()
    self.backend.free_row(slot)

  def step(self, tokens_B: np.ndarray, seeds_B: np.ndarray, counters_B: np.ndarray,
           rows: sampling.RowSampling, history_BS: np.ndarray | None,
           active_B: np.ndarray) -> np.ndarray:
    """One decode step of every row; returns each row's next token (idle rows' are junk).

    Args:
      tokens_B: each row's last token. seeds_B, counters_B: per-row PRNG seed and draw index.
      rows: per-row sampling settings.
      history_BS: prompt + generated ids (-1 padded) when some row samples or has a repetition
        penalty (the full sampler), None when every row is plain greedy.
      active_B: rows holding a request.
    """
    full = history_BS is not None
    hist = jnp.asarray(history_BS) if full else jnp.zeros((self.slots, 1), jnp.int32)
    args = (self.params, self.cache, jnp.asarray(tokens_B, jnp.int32),
            jnp.asarray(seeds_B, jnp.int32), jnp.asarray(counters_B, jnp.int32), rows, hist)
    decode = self.engine._compile(
        "decode_rows", functools.partial(self._decode_rows, full=full), (full,), (1,), *args)
    next_B, self.cache = decode(*args)
    if self.backend.needs_maintenance(self.cache):
      args = (self.cache, jnp.asarray(active_B, bool))
      run = self.engine._compile("maintain", self.backend.maintain, (), (0,), *args)
      self.cache = run(*args)
    return np.asarray(jax.block_until_ready(next_B))

  def _decode_rows(self, params, cache, tokens_B, seeds_B, counters_B, rows, history_BS, *,
                   full):
    logits_BV, cache = self.engine._decode_logits(params, cache, tokens_B)
    next_B = sampling.sample_rows(logits_BV, sampling.row_keys(seeds_B, counters_B), rows,
                                  penalize=full, stochastic=full, prev_tokens_BT=history_BS)
    return next_B, cache

  def sync(self) -> None:
    """Waits for every dispatched program (before host-side store calls)."""
    jax.block_until_ready(self.cache)

  def row_stats(self) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in self.backend.row_stats(self.cache).items()}
