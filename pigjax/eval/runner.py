"""Runs one model under several attention backends from ONE shared dense prefill.

The harness prefills each batch of examples densely once (`Runner.prefill`), then for every
method turns a copy of that dense cache into the method's cache (`Runner.start`: the backend's
`after_prefill`), and feeds tokens one jitted decode step at a time (`teacher_force`, `greedy`),
collecting next-token log-probabilities. The step is the Engine's decode step without sampling:
`(params, cache, token_B) -> (logprobs_BV, cache)`, compiled once per backend and shape.

Shape key: B batch   T tokens   V vocab   S cache positions
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pigjax import attention
from pigjax.config import Config
from pigjax.model import Llama


class Runner:

  def __init__(self, cfg: Config, model: Llama, chunk: int = 512):
    self.cfg = cfg
    self.graphdef, self.params = nnx.split(model)
    self.dtype = model.dtype
    self.chunk = chunk
    self._prefill = jax.jit(self._prefill_chunk, donate_argnums=(1,))
    self._steps: dict[int, tuple] = {}

  def _prefill_chunk(self, params, cache, tokens_BT, n_valid):
    model = nnx.merge(self.graphdef, params)
    T = tokens_BT.shape[1]
    positions_BT = cache.lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    h_BTE, cache = model(tokens_BT, positions_BT, attention.dense_attend, cache)
    h_BE = jax.lax.dynamic_index_in_dim(h_BTE, n_valid - 1, axis=1, keepdims=False)
    cache = dataclasses.replace(cache, lengths_B=cache.lengths_B + n_valid)
    return jax.nn.log_softmax(model.logits(h_BE[:, None])[:, 0]), cache

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
      lp, cache = self._prefill(self.params, cache, jnp.asarray(part), jnp.int32(n))
    return cache, np.asarray(lp)

  # -- decode under a backend ---------------------------------------------------------------

  def _step_fn(self, backend):
    key = id(backend)
    if key not in self._steps:
      def step(params, cache, tok_B):
        model = nnx.merge(self.graphdef, params)
        h_B1E, cache = model(tok_B[:, None], cache.lengths_B[:, None], backend.decode_attend,
                             cache)
        cache = dataclasses.replace(cache, lengths_B=cache.lengths_B + 1)
        return jax.nn.log_softmax(model.logits(h_B1E)[:, 0]), cache
      self._steps[key] = (backend, jax.jit(step, donate_argnums=(1,)))
    return self._steps[key][1]

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
    step = self._step_fn(backend)
    out = []
    for t in range(feed_BT.shape[1]):
      lp, cache = step(self.params, cache, jnp.asarray(feed_BT[:, t], jnp.int32))
      cache = backend.after_step(cache)
      out.append(lp)
    if not out:
      return np.zeros((feed_BT.shape[0], 0, 0), np.float32), cache
    return np.stack([np.asarray(x) for x in out], axis=1), cache

  def greedy(self, backend, cache, lp_BV: np.ndarray, n: int):
    """Greedy continuation of n tokens, the first chosen from lp_BV; returns ids [B, n]."""
    step = self._step_fn(backend)
    toks = [np.argmax(lp_BV, axis=-1)]
    for _ in range(n - 1):
      lp, cache = step(self.params, cache, jnp.asarray(toks[-1], jnp.int32))
      cache = backend.after_step(cache)
      toks.append(np.argmax(np.asarray(lp), axis=-1))
    return np.stack(toks, axis=1), cache
