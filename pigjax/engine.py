"""Prefill + decode loop: batched prompts, chunked prefill, one jitted decode step per token.

The decode step is a pure function `(params, cache, tokens, key, ...) -> (next tokens, cache)`
compiled once per (batch, cache size, sampling settings) and donating the cache, in the style of
jax-llm-examples' `decode_step`. The attention backend (dense, or MagicPIG in `pigjax.magicpig`)
owns the cache layout; this module only drives it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pigjax import attention, host_attention, multihost, sampling
from pigjax.config import Config, SamplingConfig
from pigjax.model import Llama
from pigjax.sharding import Sharding


@dataclasses.dataclass
class GenerationResult:
  prompt_ids: list[int]
  token_ids: list[int]  # generated tokens (stop token excluded)
  text: str
  stop_reason: str  # "stop_id" | "stop_string" | "length"


@dataclasses.dataclass
class GenerationStats:
  batch: int = 1
  prompt_tokens: int = 0  # summed over the batch
  generated_tokens: int = 0
  compile_s: float = 0.0  # tracing + XLA compilation, excluded from the times below
  prefill_s: float = 0.0  # time to first token, after compilation
  decode_s: float = 0.0
  extra: dict = dataclasses.field(default_factory=dict)  # backend stats (pool fraction, ...)

  @property
  def decode_tokens_per_s(self) -> float:
    """Tokens produced by decode steps per second (each slot's first token comes from prefill)."""
    decoded = self.generated_tokens - self.batch
    return decoded / self.decode_s if self.decode_s > 0 and decoded > 0 else float("nan")


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _bucket(n: int, smallest: int) -> int:
  """The smallest power of two >= max(n, smallest)."""
  return max(smallest, 1 << (n - 1).bit_length())


class Backend(Protocol):
  """What the engine needs from an attention backend (DenseBackend, magicpig.MagicPigBackend,
  eval.policies.PoolPolicyBackend)."""
  compile_s: float  # seconds the backend spent compiling its own programs

  def create_cache(self, batch: int, max_len: int, dtype) -> Any: ...
  def prefill_attend(self, layer: int, q_BTHD, k_BTKD, v_BTKD, cache) -> tuple[Any, Any]: ...
  def decode_attend(self, layer: int, q_BTHD, k_BTKD, v_BTKD, cache) -> tuple[Any, Any]: ...
  def after_prefill(self, cache, lengths_B: np.ndarray) -> Any: ...
  def after_step(self, cache) -> Any: ...
  def stats(self, cache) -> dict: ...


class Engine:
  """Runs a `Llama` with a given attention backend over batches of token-id prompts."""

  def __init__(self, cfg: Config, model: Llama, backend: Backend | None = None):
    self.cfg = cfg
    self.model = model
    self.graphdef, self.params = nnx.split(model)
    # Under a mesh (cfg.mesh) the parameters and caches are placed on it (pigjax.sharding).
    self.sharding = Sharding.create(cfg.mesh, cfg.model)
    self.params = self.sharding.place_params(self.params)
    self.backend = backend or DenseBackend(cfg)
    self.cache_dtype = kv_cache_dtype(cfg, model.dtype)
    self._compiled: dict[Any, Callable] = {}

  # -- jitted pieces ------------------------------------------------------------------------

  def _forward(self, params, tokens_BT, cache, attend):
    model = nnx.merge(self.graphdef, params)
    T = tokens_BT.shape[1]
    positions_BT = cache.lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    return model, model(tokens_BT, positions_BT, attend, cache)

  def _prefill_chunk(self, params, cache, tokens_BT, n_valid_B, last_hidden_BE):
    """Prefills one chunk; keeps the hidden state of each slot's last real prompt token."""
    model, (h_BTE, cache) = self._forward(params, tokens_BT, cache, self.backend.prefill_attend)
    idx_B = jnp.clip(n_valid_B - 1, 0, tokens_BT.shape[1] - 1)
    h_last_BE = jnp.take_along_axis(h_BTE, idx_B[:, None, None], axis=1)[:, 0]
    last_hidden_BE = jnp.where((n_valid_B > 0)[:, None], h_last_BE, last_hidden_BE)
    cache = dataclasses.replace(cache, lengths_B=cache.lengths_B + n_valid_B)
    return self.sharding.constrain_cache(cache), self.sharding.constrain_rows(last_hidden_BE)

  def _hidden_logits(self, params, last_hidden_BE):
    """Next-token logits from final hidden states (the first token after prefill)."""
    model = nnx.merge(self.graphdef, params)
    return model.logits(last_hidden_BE[:, None])[:, 0]

  def _decode_logits(self, params, cache, tokens_B):
    """One decode step's forward: next-token logits and the updated cache (the sampling is the
    caller's, so `pigjax.serving` can sample each row with its own parameters)."""
    model, (h_B1E, cache) = self._forward(params, tokens_B[:, None], cache,
                                          self.backend.decode_attend)
    cache = dataclasses.replace(cache, lengths_B=cache.lengths_B + 1)
    return model.logits(h_B1E)[:, 0], self.sharding.constrain_cache(cache)

  def _first_token(self, params, last_hidden_BE, key, history_BS, sc: SamplingConfig):
    return self.sharding.constrain_rows(
        _sample(self._hidden_logits(params, last_hidden_BE), key, history_BS, sc))

  def _decode_step(self, params, cache, tokens_B, key, history_BS, sc: SamplingConfig):
    logits_BV, cache = self._decode_logits(params, cache, tokens_B)
    return self.sharding.constrain_rows(_sample(logits_BV, key, history_BS, sc)), cache

  def _compile(self, name: str, fn: Callable, static: tuple, donate: tuple, *args) -> Callable:
    leaves, treedef = jax.tree.flatten(args)
    key = (name, static, treedef, tuple((x.shape, x.dtype) for x in leaves))
    if key not in self._compiled:
      jitted = jax.jit(fn, donate_argnums=donate)
      self._compiled[key] = jitted.lower(*args).compile()
    return self._compiled[key]

  # -- public API ---------------------------------------------------------------------------

  def generate(self, prompts: Sequence[Sequence[int]], sc: SamplingConfig,
               stop: Callable[[int, list[int]], str | None] | None = None,
               on_token: Callable[[int, int], None] | None = None,
               progress: bool = False) -> tuple[list[list[int]], list[str], GenerationStats]:
    """Generates for a batch of token-id prompts.

    Args:
      prompts: B prompts (token ids), any lengths >= 1.
      sc: sampling settings (validated here).
      stop: `stop(slot, new_ids) -> reason or None`, called after each token of a slot.
      on_token: `on_token(slot, token_id)` called as tokens are produced (streaming).
      progress: show a progress bar over prefill chunks.
    Returns:
      (new token ids per slot, stop reason per slot, stats).
    """
    sampling.validate_sampling(sc.temperature, sc.top_k, sc.top_p, sc.min_p,
                               sc.repetition_penalty, sc.max_new_tokens)
    B = len(prompts)
    lengths = [len(p) for p in prompts]
    if B == 0 or min(lengths) < 1:
      raise ValueError("Every prompt needs at least one token.")
    limit = min(self.cfg.model.max_position, self.cfg.max_seq_len)
    if max(lengths) + sc.max_new_tokens > limit:
      raise ValueError(
          f"Prompt of {max(lengths)} tokens plus max_new_tokens={sc.max_new_tokens} exceeds the "
          f"context limit of {limit} tokens (model max_position={self.cfg.model.max_position}, "
          f"config max_seq_len={self.cfg.max_seq_len}).")
    stats = GenerationStats(batch=B, prompt_tokens=sum(lengths))
    chunk = self.cfg.prefill_chunk
    # Under jax.distributed every process passes its own rows of one global batch: the shapes
    # follow the longest prompt of any process (pigjax.multihost; identities for one process).
    batch = multihost.same_everywhere(B, "number of prompts") * jax.process_count()
    longest = multihost.global_max(max(lengths))
    sh = self.sharding
    if batch % sh.data:
      raise ValueError(f"A batch of {batch} prompts does not split over mesh.data={sh.data} "
                       f"devices; give a multiple of {sh.data} prompts.")
    # Shapes are bucketed (powers of two, then multiples of the chunk) so that few distinct
    # programs are compiled across calls.
    step_len = min(chunk, _bucket(longest, 32))
    padded = _round_up(longest, step_len)
    cache_len = min(_bucket(longest + sc.max_new_tokens, 256),
                    _round_up(longest + sc.max_new_tokens, 1024))
    tokens_BP = np.zeros((B, padded), np.int32)
    for b, p in enumerate(prompts):
      tokens_BP[b, :len(p)] = p
    history_BS = np.full((B, cache_len), -1, np.int32)  # prompt + generated ids, for penalties
    for b, p in enumerate(prompts):
      history_BS[b, :len(p)] = p
    lengths_B = np.array(lengths, np.int32)

    cache = sh.place_cache(self.backend.create_cache(batch, cache_len, self.cache_dtype))
    last_hidden_BE = sh.rows(np.zeros((B, self.cfg.model.hidden_size), self.model.dtype))
    key = sh.replicated(jax.random.key(sc.seed))
    history = sh.rows(history_BS)

    # Compile everything before the clock starts (compile time is reported separately).
    t0 = time.perf_counter()
    tok0 = sh.rows(tokens_BP[:, :step_len])
    nval0 = sh.rows(np.clip(lengths_B, 0, step_len))
    prefill = self._compile("prefill", self._prefill_chunk, (), (1,), self.params, cache, tok0,
                            nval0, last_hidden_BE)
    first = self._compile("first", functools.partial(self._first_token, sc=sc), (sc,), (),
                          self.params, last_hidden_BE, key, history)
    stats.compile_s += time.perf_counter() - t0

    t0 = time.perf_counter()
    starts = range(0, padded, step_len)
    if progress and len(starts) > 1:
      from tqdm import tqdm
      starts = tqdm(starts, desc="prefill", unit="chunk", leave=False)
    for s in starts:
      n_valid = np.clip(lengths_B - s, 0, step_len).astype(np.int32)
      cache, last_hidden_BE = prefill(self.params, cache, sh.rows(tokens_BP[:, s:s + step_len]),
                                      sh.rows(n_valid), last_hidden_BE)
    # The backend compiles its own programs lazily (MagicPIG's store maintenance, seconds on first
    # use) and that time is taken out of prefill_s below. The chunks above are only dispatched:
    # wait for them first, or the prefill running under that compile would be taken out too
    # (a first 2048-token MagicPIG prefill read 3.8 s, the next one 10.6 s, on a loaded machine).
    jax.block_until_ready(last_hidden_BE)
    compile_before = self.backend.compile_s
    cache = self.backend.after_prefill(cache, lengths_B)
    key, sub = jax.random.split(key)
    next_B = sh.local_rows(first(self.params, last_hidden_BE, sub, history))
    prefill_compile = self.backend.compile_s - compile_before
    stats.prefill_s = time.perf_counter() - t0 - prefill_compile
    stats.compile_s += prefill_compile

    t0 = time.perf_counter()
    decode = self._compile("decode", functools.partial(self._decode_step, sc=sc), (sc,), (1,),
                           self.params, cache, sh.rows(next_B), key, history)
    stats.compile_s += time.perf_counter() - t0

    new_ids: list[list[int]] = [[] for _ in range(B)]
    reasons: list[str | None] = [None] * B
    t0 = time.perf_counter()
    for step in range(sc.max_new_tokens):
      for b in range(B):
        if reasons[b] is None:
          tok = int(next_B[b])
          new_ids[b].append(tok)
          history_BS[b, lengths[b] + step] = tok
          reason = stop(b, new_ids[b]) if stop else None
          if reason is not None:
            reasons[b] = reason
          elif on_token:
            on_token(b, tok)
      if step == sc.max_new_tokens - 1 or multihost.all_true(all(r is not None for r in reasons)):
        break
      key, sub = jax.random.split(key)
      hist = sh.rows(history_BS) if sc.repetition_penalty != 1.0 else history
      next_tok, cache = decode(self.params, cache, sh.rows(next_B), sub, hist)
      cache = self.backend.after_step(cache)
      next_B = sh.local_rows(next_tok)
    decode_compile = self.backend.compile_s - compile_before - prefill_compile
    stats.decode_s = time.perf_counter() - t0 - decode_compile
    stats.compile_s += decode_compile
    stats.generated_tokens = sum(len(ids) for ids in new_ids)
    stats.extra.update(self.backend.stats(cache))
    return new_ids, [r or "length" for r in reasons], stats


def _sample(logits_BV, key, history_BS, sc: SamplingConfig):
  return sampling.sample(logits_BV, key, temperature=sc.temperature, top_k=sc.top_k,
                         top_p=sc.top_p, min_p=sc.min_p,
                         repetition_penalty=sc.repetition_penalty,
                         prev_tokens_BT=history_BS if sc.repetition_penalty != 1.0 else None)


def kv_cache_dtype(cfg: Config, model_dtype) -> jnp.dtype:
  """The KV cache's dtype: `cfg.cache_dtype`, or the model's for "auto"."""
  return jnp.dtype(model_dtype if cfg.cache_dtype == "auto" else cfg.cache_dtype)


class DenseBackend:
  """Full attention over a device cache in every layer."""

  compile_s = 0.0  # nothing compiled outside the engine

  def __init__(self, cfg: Config):
    self.cfg = cfg
    self.decode_attend = functools.partial(attention.dense_attend,
                                           host=host_attention.use_host_kernel(cfg))

  def create_cache(self, batch: int, max_len: int, dtype) -> attention.DenseCache:
    m = self.cfg.model
    return attention.DenseCache.create(m.num_layers, batch, m.num_kv_heads, max_len, m.head_dim,
                                       dtype)

  prefill_attend = staticmethod(attention.dense_attend)

  def after_prefill(self, cache, lengths_B):
    return cache

  def after_step(self, cache):
    return cache

  def stats(self, cache) -> dict:
    return {}
