"""Offline generation: batched prompts, chunked prefill, one jitted decode step per token.

`Engine` is a driver over `pigjax.step.StepCore` (the model's pure prefill-chunk, first-token and
decode-step functions and their compile cache): it pads and buckets the batch, runs the chunks,
samples every row with one `SamplingConfig` (`step.UniformSampler`) and stops rows as they finish.
The attention backend (dense, or MagicPIG in `pigjax.magicpig`) owns the cache layout.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import numpy as np

from pigjax import multihost, sampling
from pigjax.attention import DenseBackend
from pigjax.config import Config, SamplingConfig
from pigjax.model import Llama
from pigjax.step import (Backend, Programs, StepCore, UniformSampler, bucket, kv_cache_dtype,
                         round_up)


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


class Engine:
  """Runs a `Llama` with a given attention backend over batches of token-id prompts: a driver
  over `pigjax.step.StepCore`."""

  def __init__(self, cfg: Config, model: Llama, backend: Backend | None = None):
    self.cfg = cfg
    self.model = model
    self.backend = backend or DenseBackend(cfg)
    self.core = StepCore(cfg, model, self.backend)
    self.cache_dtype = kv_cache_dtype(cfg, model.dtype)

  @property
  def params(self):
    return self.core.params

  @property
  def sharding(self):
    return self.core.sharding

  @property
  def programs(self) -> Programs:
    """The compiled model programs (prefill, first, decode) by shape and sampling setting."""
    return self.core.programs

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
    step_len = min(chunk, bucket(longest, 32))
    padded = round_up(longest, step_len)
    cache_len = min(bucket(longest + sc.max_new_tokens, 256),
                    round_up(longest + sc.max_new_tokens, 1024))
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
    core, sampler = self.core, UniformSampler(sc)
    compile_before = core.compile_s
    tok0 = sh.rows(tokens_BP[:, :step_len])
    nval0 = sh.rows(np.clip(lengths_B, 0, step_len))
    prefill = core.programs.get("prefill", core.prefill_chunk, self.params, cache, tok0, nval0,
                                last_hidden_BE, donate=(1,))
    first = core.programs.get("first", functools.partial(core.first_token, sampler=sampler),
                              self.params, last_hidden_BE, key, history, static=(sampler,))
    stats.compile_s += core.compile_s - compile_before

    t0 = time.perf_counter()
    starts = range(0, padded, step_len)
    if progress and len(starts) > 1:
      from tqdm import tqdm
      starts = tqdm(starts, desc="prefill", unit="chunk", leave=False)
    for s in starts:
      n_valid = np.clip(lengths_B - s, 0, step_len).astype(np.int32)
      cache, last_hidden_BE = prefill(self.params, cache, sh.rows(tokens_BP[:, s:s + step_len]),
                                      sh.rows(n_valid), last_hidden_BE)
    # The backend compiles its own programs on first use (MagicPIG's store maintenance, seconds)
    # and that time is taken out of prefill_s below. The chunks above are only dispatched:
    # wait for them first, or the prefill running under that compile would be taken out too
    # (a first 2048-token MagicPIG prefill read 3.8 s, the next one 10.6 s, on a loaded machine).
    jax.block_until_ready(last_hidden_BE)
    compile_before = core.compile_s
    cache = self.backend.after_prefill(cache, lengths_B)
    key, sub = jax.random.split(key)
    next_B = sh.local_rows(first(self.params, last_hidden_BE, sub, history))
    prefill_compile = core.compile_s - compile_before
    stats.prefill_s = time.perf_counter() - t0 - prefill_compile
    stats.compile_s += prefill_compile

    compile_before = core.compile_s
    decode = core.programs.get("decode", functools.partial(core.decode_step, sampler=sampler),
                               self.params, cache, sh.rows(next_B), key, history, donate=(1,),
                               static=(sampler,))
    stats.compile_s += core.compile_s - compile_before
    compile_before = core.compile_s

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
    decode_compile = core.compile_s - compile_before
    stats.decode_s = time.perf_counter() - t0 - decode_compile
    stats.compile_s += decode_compile
    stats.generated_tokens = sum(len(ids) for ids in new_ids)
    stats.extra.update(self.backend.stats(cache))
    return new_ids, [r or "length" for r in reasons], stats

