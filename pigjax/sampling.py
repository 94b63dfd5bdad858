"""Next-token sampling: greedy, temperature, top-k, top-p, min-p and repetition penalty.

The order of operations follows Hugging Face `generate`: repetition penalty (CTRL, Keskar et al.
2019, sec. 4.1: divide a seen token's positive logit by the penalty, multiply a negative one),
then temperature, then top-k, top-p (nucleus, Holtzman et al. 2020) and min-p filtering, then a
categorical draw. Each filter keeps at least the most likely token.

`sample` is pure jnp and jit-friendly: a parameter given as a Python number that switches its
filter off (top_k=0, top_p=1, min_p=0, repetition_penalty=1) removes that stage at trace time;
temperature=0 as a Python number is plain argmax. The same parameters may also be traced scalars
or per-row arrays of shape [B].

Shape letters: B batch, V vocabulary, T previously seen tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp


def _is_static(x: Any, value: float) -> bool:
  """True if `x` is a concrete Python number equal to `value` (so the stage can be skipped)."""
  return isinstance(x, (int, float)) and not isinstance(x, bool) and x == value


def _per_row(x: Any, B: int, dtype) -> jax.Array:
  """A scalar or [B] parameter as a [B, 1] column."""
  return jnp.broadcast_to(jnp.asarray(x, dtype), (B,))[:, None]


def apply_repetition_penalty(logits_BV: jax.Array, prev_tokens_BT: jax.Array, penalty) -> jax.Array:
  """Penalises every token id in `prev_tokens_BT` (int32, -1 = padding), HF style.

  Args:
    logits_BV: float logits.
    prev_tokens_BT: ids already in each sequence (prompt and generated); -1 entries are ignored.
    penalty: > 0; 1 is a no-op, > 1 discourages repeats.
  Returns:
    [B, V] logits with seen tokens' positive logits divided and negative ones multiplied.
  """
  B, V = logits_BV.shape
  prev_BT = jnp.asarray(prev_tokens_BT, jnp.int32)
  valid_BT = prev_BT >= 0
  seen_BT = jnp.take_along_axis(logits_BV, jnp.where(valid_BT, prev_BT, 0), axis=1)
  p_B1 = _per_row(penalty, B, logits_BV.dtype)
  penalised_BT = jnp.where(seen_BT < 0, seen_BT * p_B1, seen_BT / p_B1)
  # Padding scatters out of bounds and is dropped; duplicate ids write the same value.
  rows_BT = jnp.broadcast_to(jnp.arange(B)[:, None], prev_BT.shape)
  return logits_BV.at[rows_BT, jnp.where(valid_BT, prev_BT, V)].set(penalised_BT, mode="drop")


def _nucleus_threshold(probs_BV: jax.Array, top_p_B1: jax.Array) -> jax.Array:
  """The largest t with sum(p[p >= t]) >= top_p per row, found without sorting the vocabulary.

  Non-negative float32 values order like their int32 bit patterns, so a 31-step bisection over
  the bits lands exactly on one of the row's probabilities. Keeping `p >= t` is the nucleus of
  Holtzman et al. (the smallest most-likely set reaching top_p), except that tokens tied at the
  boundary are all kept.
  """
  bits_BV = jax.lax.bitcast_convert_type(probs_BV, jnp.int32)
  lo_B1 = jnp.zeros_like(bits_BV[:, :1])  # mass(p >= 0) is all of it: always acceptable
  hi_B1 = jnp.max(bits_BV, axis=-1, keepdims=True) + 1  # mass(p > max) = 0 < top_p

  def step(_, lo_hi):
    lo_B1, hi_B1 = lo_hi
    mid_B1 = lo_B1 + (hi_B1 - lo_B1) // 2
    ok_B1 = jnp.sum(jnp.where(bits_BV >= mid_B1, probs_BV, 0.0), axis=-1, keepdims=True) >= top_p_B1
    return jnp.where(ok_B1, mid_B1, lo_B1), jnp.where(ok_B1, hi_B1, mid_B1)

  lo_B1, _ = jax.lax.fori_loop(0, 31, step, (lo_B1, hi_B1))
  return jax.lax.bitcast_convert_type(lo_B1, probs_BV.dtype)


def filter_logits(logits_BV: jax.Array, *, top_k=0, top_p=1.0, min_p=0.0) -> jax.Array:
  """Sets logits outside the top-k / top-p / min-p sets to -inf (already temperature-scaled).

  top_k=0, top_p=1 and min_p=0 switch the respective filter off. As in Hugging Face's
  warpers, tokens tied with the k-th largest logit are kept, and top-p acts on the top-k
  distribution renormalised. Only a traced top_k sorts the vocabulary.
  """
  B, V = logits_BV.shape
  neg_inf = jnp.array(-jnp.inf, logits_BV.dtype)
  if isinstance(top_k, int) and not isinstance(top_k, bool):
    if 0 < top_k < V:
      kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
      logits_BV = jnp.where(logits_BV >= kth_B1, logits_BV, neg_inf)
  else:
    k_B1 = _per_row(top_k, B, jnp.int32)
    sorted_BV = jnp.sort(logits_BV, axis=-1, descending=True)
    kth_B1 = jnp.take_along_axis(sorted_BV, jnp.clip(k_B1 - 1, 0, V - 1), axis=-1)
    logits_BV = jnp.where((k_B1 <= 0) | (logits_BV >= kth_B1), logits_BV, neg_inf)
  if not _is_static(top_p, 1.0):
    probs_BV = jax.nn.softmax(logits_BV.astype(jnp.float32), axis=-1)  # float32: bit bisection
    threshold_B1 = _nucleus_threshold(probs_BV, _per_row(top_p, B, jnp.float32))
    logits_BV = jnp.where(probs_BV >= threshold_B1, logits_BV, neg_inf)
  if not _is_static(min_p, 0.0):
    # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
    max_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
    log_min_p_B1 = jnp.log(_per_row(min_p, B, logits_BV.dtype))
    logits_BV = jnp.where(logits_BV >= max_B1 + log_min_p_B1, logits_BV, neg_inf)
  return logits_BV


def sample(
    logits_BV: jax.Array,
    key: jax.Array,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    repetition_penalty=1.0,
    prev_tokens_BT: jax.Array | None = None,
) -> jax.Array:
  """Draws one next token per row.

  Args:
    logits_BV: next-token logits (any float dtype; computed in float32).
    key: a PRNG key; one key serves the whole batch (rows draw independently).
    temperature: 0 = greedy argmax; otherwise logits are divided by it.
    top_k: keep the k most likely tokens; 0 = off.
    top_p: keep the smallest set of tokens whose probability reaches top_p; 1 = off.
    min_p: keep tokens with probability >= min_p * max probability; 0 = off.
    repetition_penalty: HF-style penalty on tokens in `prev_tokens_BT`; 1 = off.
    prev_tokens_BT: int32 ids seen so far, -1 padded; needed only for the penalty.
  Returns:
    int32[B] token ids.
  """
  logits_BV = jnp.asarray(logits_BV, jnp.float32)
  B = logits_BV.shape[0]
  if prev_tokens_BT is not None and not _is_static(repetition_penalty, 1.0):
    logits_BV = apply_repetition_penalty(logits_BV, prev_tokens_BT, repetition_penalty)
  greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  if _is_static(temperature, 0.0):
    return greedy_B
  t_B1 = _per_row(temperature, B, jnp.float32)
  scaled_BV = logits_BV / jnp.where(t_B1 > 0, t_B1, 1.0)
  filtered_BV = filter_logits(scaled_BV, top_k=top_k, top_p=top_p, min_p=min_p)
  drawn_B = jax.random.categorical(key, filtered_BV, axis=-1).astype(jnp.int32)
  return jnp.where(t_B1[:, 0] > 0, drawn_B, greedy_B)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowSampling:
  """Per-row sampling parameters as [B] arrays, so one compiled step serves rows with different
  settings (continuous batching): changing a row's values never recompiles.

  Off values: temperature 0 (greedy), top_k 0, top_p 1, min_p 0, repetition_penalty 1.
  """
  temperature_B: jax.Array  # float32
  top_k_B: jax.Array  # int32
  top_p_B: jax.Array  # float32
  min_p_B: jax.Array  # float32
  repetition_penalty_B: jax.Array  # float32

  @classmethod
  def from_rows(cls, rows: Sequence[Any]) -> RowSampling:
    """From objects with temperature, top_k, top_p, min_p and repetition_penalty attributes
    (e.g. `SamplingConfig`), one per row."""
    import numpy as np
    col = lambda name, dtype: jnp.asarray(np.array([getattr(r, name) for r in rows], dtype))
    return cls(col("temperature", np.float32), col("top_k", np.int32), col("top_p", np.float32),
               col("min_p", np.float32), col("repetition_penalty", np.float32))


def row_keys(seeds_B: jax.Array, counters_B: jax.Array) -> jax.Array:
  """One PRNG key per row from its own seed and its own token counter, so a row's draws do not
  depend on which other rows share the batch or when it joined."""
  return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds_B, counters_B)


def sample_rows(logits_BV: jax.Array, keys_B: jax.Array, params: RowSampling, *,
                penalize: bool = True, stochastic: bool = True,
                prev_tokens_BT: jax.Array | None = None) -> jax.Array:
  """Draws one next token per row, each row with its own parameters and key.

  Args:
    logits_BV: next-token logits.
    keys_B: one PRNG key per row (`row_keys`).
    params: per-row settings.
    penalize: static; False drops the repetition-penalty stage (every row's penalty is 1).
    stochastic: static; False drops the sampling stages (every row is greedy). Both switches
      only remove work: a row gets the same token either way when its own settings are off.
    prev_tokens_BT: int32 ids seen so far per row, -1 padded (needed when `penalize`).
  Returns:
    int32[B] token ids.
  """
  logits_BV = jnp.asarray(logits_BV, jnp.float32)
  if penalize:
    if prev_tokens_BT is None:
      raise ValueError("sample_rows(penalize=True) needs prev_tokens_BT.")
    logits_BV = apply_repetition_penalty(logits_BV, prev_tokens_BT, params.repetition_penalty_B)
  greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  if not stochastic:
    return greedy_B
  t_B1 = params.temperature_B[:, None]
  scaled_BV = logits_BV / jnp.where(t_B1 > 0, t_B1, 1.0)
  filtered_BV = filter_logits(scaled_BV, top_k=params.top_k_B, top_p=params.top_p_B,
                              min_p=params.min_p_B)
  drawn_B = jax.vmap(jax.random.categorical)(keys_B, filtered_BV).astype(jnp.int32)
  return jnp.where(params.temperature_B > 0, drawn_B, greedy_B)


FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)  # the largest value a [B] float operand holds


def validate_sampling(temperature, top_k, top_p, min_p, repetition_penalty=1.0,
                      max_new_tokens=1) -> None:
  """Raises ValueError naming the first out-of-range sampling parameter (before any model work).

  The upper bounds are the [B] operands' (`RowSampling`): top_k is int32, the others float32.
  """
  integral = lambda v: isinstance(v, int) or float(v).is_integer()  # float() of a huge int raises
  checks = [
      (temperature >= 0, f"temperature must be >= 0 (0 means greedy), got {temperature}."),
      (temperature < FLOAT32_MAX, f"temperature must be finite, got {temperature}."),
      (top_k >= 0 and integral(top_k),
       f"top_k must be an integer >= 0 (0 means off), got {top_k}."),
      (top_k < 2**31, f"top_k must be below 2**31 (an int32), got {top_k}."),
      (0 < top_p <= 1, f"top_p must be in (0, 1] (1 means off), got {top_p}."),
      (0 <= min_p < 1, f"min_p must be in [0, 1) (0 means off), got {min_p}."),
      (repetition_penalty > 0,
       f"repetition_penalty must be > 0 (1 means off), got {repetition_penalty}."),
      (repetition_penalty < FLOAT32_MAX,
       f"repetition_penalty must be finite, got {repetition_penalty}."),
      (max_new_tokens >= 1 and integral(max_new_tokens),
       f"max_new_tokens must be an integer >= 1, got {max_new_tokens}."),
  ]
  for ok, message in checks:
    if not ok:  # NaN fails every comparison, so it is rejected too
      raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class StopStatus:
  """Whether to stop, and the new text to show.

  Attributes:
    stopped: a stop id was generated or a stop string appeared.
    text: the decoded new text, ending before the stop id / stop string.
    num_tokens: how many of the new ids to keep (those up to, not including, a stop id; those
      up to and including the one that completed a stop string; all of them otherwise).
    reason: "stop_id", "stop_string" or None.
  """

  stopped: bool
  text: str
  num_tokens: int
  reason: str | None = None


class StopChecker:
  """Host-side stop test for one sequence's generated ids (stateless; call per row).

  Args:
    stop_ids: ids that end generation (e.g. `tokenizer.eos_ids`).
    stop_strings: strings that end generation when they appear in the decoded new text.
    tokenizer: anything with `decode(ids) -> str`; needed only for text and stop strings.
  """

  def __init__(self, stop_ids: Iterable[int] = (), stop_strings: Iterable[str] = (),
               tokenizer: Any = None):
    self.stop_ids = frozenset(int(i) for i in stop_ids)
    self.stop_strings = tuple(s for s in stop_strings if s)
    if self.stop_strings and tokenizer is None:
      raise ValueError("stop_strings need a tokenizer to decode the generated ids.")
    self.tokenizer = tokenizer

  def _decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(list(ids)) if self.tokenizer is not None else ""

  def check(self, new_ids: Sequence[int]) -> StopStatus:
    """Checks the ids generated so far (excluding the prompt)."""
    new_ids = [int(i) for i in new_ids]
    n = next((i for i, t in enumerate(new_ids) if t in self.stop_ids), len(new_ids))
    text = self._decode(new_ids[:n])
    hits = [(text.find(s), s) for s in self.stop_strings]
    hits = [(pos, s) for pos, s in hits if pos >= 0]
    if hits:
      pos, s = min(hits)
      # The token that completed the stop string: the shortest prefix whose text contains it.
      keep = next(j for j in range(1, n + 1) if s in self._decode(new_ids[:j]))
      return StopStatus(True, text[:pos], keep, "stop_string")
    if n < len(new_ids):
      return StopStatus(True, text, n, "stop_id")
    return StopStatus(False, text, n, None)
