"""Runs one model under several attention backends from ONE shared dense prefill.

The harness prefills each batch of examples densely once (`Runner.prefill`), then for every
method turns a copy of that dense cache into the method's cache (`Runner.start`: the backend's
`after_prefill`), and feeds tokens one jitted decode step at a time (`teacher_force`, `greedy`),
collecting next-token log-probabilities. The pieces are `pigjax.step.StepCore`'s, the same the
Engine drives, without sampling: `(params, cache, token_B) -> (logprobs_BV, cache)`, compiled once
per backend and shape.

Shape key: B batch   T tokens   V vocab   S cache positions
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pigjax import attention
from pigjax.config import Config
from pigjax.model import Llama
from pigjax.step import StepCore


class Runner:

  def __init__(self, cfg: Config, model: Llama, chunk: int = 512):
    self.cfg = cfg
    self.model = model
    self.dtype = model.dtype
    self.chunk = chunk
    self.dense = StepCore(cfg, model, attention.DenseBackend(cfg))
    self.params = self.dense.params
    self._cores: dict[int, tuple] = {}  # id(backend) -> (backend, its StepCore)

  def _core(self, backend) -> StepCore:
    """The step core over `backend` (one per backend; the parameters are shared, not copied)."""
    if id(backend) not in self._cores:
      self._cores[id(backend)] = (backend, StepCore(self.cfg, self.model, backend))
    return self._cores[id(backend)][1]

  def _prefill_chunk(self, params, cache, tokens_BT, n_valid_B):
    B = tokens_BT.shape[0]
    none_BE = jnp.zeros((B, self.cfg.model.hidden_size), self.dtype)
    cache, h_BE = self.dense.prefill_chunk(params, cache, tokens_BT, n_valid_B, none_BE)
    return jax.nn.log_softmax(self.dense.first_logits(params, h_BE)), cache

  def prefill(self, ids_BT: np.ndarray, cache_len: int) -> tuple[attention.DenseCache, np.ndarray]:
    """Dense prefill of equal-length prompts; returns (cache, logprobs_BV of the last token)."""
    m = self.cfg.model
    B, T = ids_BT.shape
    if T >= cache_len:
      raise ValueError(f"prompt of {T} tokens does not fit a cache of {cache_len}.")
    cache = attention.DenseCache.create(m.num_layers, B, m.num_kv_heads, cache_len, m.head_dim,
                                        self.dtype)
    return self.extend(cache, ids_BT)

  def extend(self, cache: attention.DenseCache, ids_BT: np.ndarray, copy: bool = False):
    """Dense prefill of more tokens onto `cache` (chunks padded to `chunk`; the padding is written
    past the length, never visible, and overwritten by later tokens)."""
    if copy:
      cache = jax.tree.map(jnp.copy, cache)
    B, T = ids_BT.shape
    step = min(self.chunk, T)
    lp = None
    for s in range(0, T, step):
      part = np.zeros((B, step), np.int32)
      n = min(step, T - s)
      part[:, :n] = ids_BT[:, s:s + n]
      lp, cache = self.dense.programs.run("prefill_logprobs", self._prefill_chunk, self.params,
                                          cache, jnp.asarray(part), jnp.full((B,), n, jnp.int32),
                                          donate=(1,))
    return cache, np.asarray(lp)

  # -- decode under a backend ---------------------------------------------------------------

  def _step(self, backend, cache, tok_B):
    """One teacher-forced decode step under `backend`: (logprobs_BV, cache)."""
    core = self._core(backend)

    def step(params, cache, tok_B):
      logits_BV, cache = core.decode_logits(params, cache, tok_B)
      return jax.nn.log_softmax(logits_BV), cache
    return core.programs.run("step_logprobs", step, self.params, cache, tok_B, donate=(1,))

  def start(self, backend, dense: attention.DenseCache):
    """The backend's decode cache from a copy of a dense prefill cache (left untouched)."""
    dense = jax.tree.map(jnp.copy, dense)
    if hasattr(backend, "store"):  # MagicPigBackend: (re)size and reset its host store first
      B, S = dense.lengths_B.shape[0], dense.max_len
      backend.create_cache(B, S, self.dtype)
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      return backend.after_prefill(dense, np.asarray(dense.lengths_B))

  def teacher_force(self, backend, cache, feed_BT: np.ndarray):
    """Feeds tokens one decode step each; returns (logprobs [B, T, V] after each token, cache)."""
    out = []
    for t in range(feed_BT.shape[1]):
      lp, cache = self._step(backend, cache, jnp.asarray(feed_BT[:, t], jnp.int32))
      cache = backend.after_step(cache)
      out.append(lp)
    if not out:
      return np.zeros((feed_BT.shape[0], 0, 0), np.float32), cache
    return np.stack([np.asarray(x) for x in out], axis=1), cache

  def greedy(self, backend, cache, lp_BV: np.ndarray, n: int):
    """Greedy continuation of n tokens, the first chosen from lp_BV; returns ids [B, n]."""
    toks = [np.argmax(lp_BV, axis=-1)]
    for _ in range(n - 1):
      lp, cache = self._step(backend, cache, jnp.asarray(toks[-1], jnp.int32))
      cache = backend.after_step(cache)
      toks.append(np.argmax(np.asarray(lp), axis=-1))
    return np.stack(toks, axis=1), cache
