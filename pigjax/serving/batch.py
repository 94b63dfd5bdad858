"""The device side of continuous batching: a running cache of fixed `slots` rows and the compiled
programs that prefill one request, put it into a row, and step every row at once.

All programs are compiled once per shape and reused across requests: the running batch always has
`slots` rows and `cache_len` positions, prefill chunks are bucketed (powers of two up to
`prefill_chunk`), and each row's sampling parameters are [B] operands (`sampling.RowSampling`), so
admitting a request with new settings never recompiles. The one static switch: a plain-greedy
program while every row is greedy without penalty, the full sampler otherwise (two programs; a
greedy row gets the same token from both).

The model pieces are `pigjax.step.StepCore`'s (the same prefill-chunk, first-token and decode-step
functions `Engine` drives, and their compile cache), sampling each row with its own settings
(`step.RowSampler`); the backend's row operations (`step.RowBackend`: `insert_row`, `free_row`,
`maintain`) put a prefilled request into a row and keep its generated buffer.

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
from pigjax.model import Llama
from pigjax.step import RowSampler, StepCore, bucket, kv_cache_dtype, make_backend


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
    self.backend = make_backend(cfg)
    self.core = StepCore(cfg, model, self.backend)
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      self.cache_dtype = kv_cache_dtype(cfg, model.dtype)
      self.cache = self.backend.init_running(slots, cache_len, self.cache_dtype)
    self.hidden = cfg.model.hidden_size
    self.dtype = model.dtype

  @property
  def params(self):
    return self.core.params

  @property
  def programs(self):
    """The compiled programs (prefill buckets, row insert, first token, decode, maintenance)."""
    return self.core.programs

  # -- prefill ------------------------------------------------------------------------------

  def start_prefill(self, prompt_ids: Sequence[int]) -> Prefill:
    step_len = min(self.cfg.prefill_chunk, bucket(len(prompt_ids), 32))
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
    p.cache, p.last_hidden_1E = self.programs.run("prefill", self.core.prefill_chunk, *args,
                                                  donate=(1,))
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
      self.cache = self.programs.run("insert_row", self.backend.insert_row, *args, donate=(0,))
    args = (self.params, p.last_hidden_1E, jnp.asarray([seed], jnp.int32),
            jnp.zeros((1,), jnp.int32), rows,
            jnp.asarray(history_S[None] if full else np.zeros((1, 1), np.int32)))
    sampler = RowSampler(full)
    first = functools.partial(self.core.first_token, sampler=sampler)
    return int(self.programs.run("first_rows", first, *args, static=(sampler,))[0])

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
    sampler = RowSampler(full)
    decode = functools.partial(self.core.decode_step, sampler=sampler)
    next_B, self.cache = self.programs.run("decode_rows", decode, *args, donate=(1,),
                                           static=(sampler,))
    if self.backend.needs_maintenance(self.cache):
      self.cache = self.programs.run("maintain", self.backend.maintain, self.cache,
                                     jnp.asarray(active_B, bool), donate=(0,))
    return np.asarray(jax.block_until_ready(next_B))

  def sync(self) -> None:
    """Waits for every dispatched program (before host-side store calls)."""
    jax.block_until_ready(self.cache)

  def row_stats(self) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in self.backend.row_stats(self.cache).items()}
