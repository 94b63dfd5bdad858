"""Soak runs: long MagicPIG generations, sampled every N decode steps.

In a long generation the generated-token buffer fills again and again, and each time its older
half is hashed into the host store's pool (`MagicPigBackend.after_step`). A soak run watches
what that must not change: the process's memory apart from the pool's own growth (VmRSS and
VmHWM from /proc/self/status against `HostKVStore.memory_bytes`), the attended fraction of the
pool, and the decode speed. `compare_with_reference` checks a shorter prefix token for token
against the pure-jnp reference backend with the same evictions
(`PoolPolicyBackend(..., pool_generated=True)`).

`RecordingBackend` wraps any Engine backend whose cache carries `cand_total_B` / `pool_total_B`
(MagicPIG's). It zeroes those float32 sums after reading each interval and keeps the totals in
Python floats: over thousands of steps a float32 sum of (pool tokens x heads x layers) passes
2^24 and no longer adds small steps exactly.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pigjax.config import Config, SamplingConfig
from pigjax.engine import Engine
from pigjax.eval.policies import PoolPolicyBackend
from pigjax.eval.runner import Runner
from pigjax.magicpig import MagicPigBackend
from pigjax.store import HostKVStore

MB = 1024 * 1024


def read_memory(status_path: str = "/proc/self/status") -> dict[str, int]:
  """Current (VmRSS) and peak (VmHWM) resident set size in bytes, from a /proc status file.

  Raises:
    ValueError: the file lacks either line (not Linux, or a format this parser does not know).
  """
  found = {}
  with open(status_path, encoding="ascii") as f:
    for line in f:
      key, _, rest = line.partition(":")
      if key in ("VmRSS", "VmHWM"):
        value, unit = rest.split()
        if unit != "kB":
          raise ValueError(f"{status_path}: {key} is in {unit!r}, expected kB.")
        found[key] = int(value) * 1024
  if set(found) != {"VmRSS", "VmHWM"}:
    raise ValueError(f"{status_path} has no VmRSS/VmHWM lines (found {sorted(found)}); soak "
                     "memory readings need Linux's /proc.")
  return {"rss": found["VmRSS"], "hwm": found["VmHWM"]}


@dataclasses.dataclass
class Sample:
  step: int  # decode steps done
  tokens_per_s: float  # since the previous sample (the first interval from step 1: compiles
                       # excluded)
  rss_mb: float  # VmRSS
  hwm_mb: float  # VmHWM (peak so far)
  store_mb: float  # host store's reserved bytes (HostKVStore.memory_bytes): capacity, not RSS
  pool_tokens: int  # pool size of slot 0 (prompt pool + evicted generated tokens)
  pool_mb: float  # what those pool tokens occupy in the store (K/V rows, int8 scales, table ids)
  attended: float  # attended fraction of the pool over the interval


class RecordingBackend:
  """An Engine backend that delegates to `inner` and records a `Sample` every `every` steps."""

  def __init__(self, inner, every: int, on_sample: Callable[[Sample], None] | None = None):
    if every < 1:
      raise ValueError(f"every must be >= 1, got {every}.")
    self.inner, self.every, self.on_sample = inner, every, on_sample
    self.samples: list[Sample] = []
    self._cand = self._pool = 0.0

  def __getattr__(self, name: str) -> Any:  # prefill_attend, decode_attend, store, ...
    return getattr(self.inner, name)

  @property
  def compile_s(self) -> float:
    """Seconds the inner backend spent compiling its own programs."""
    programs = getattr(self.inner, "programs", None)
    return programs.compile_s if programs is not None else 0.0

  def create_cache(self, batch: int, max_len: int, dtype):
    return self.inner.create_cache(batch, max_len, dtype)

  def after_prefill(self, cache, lengths_B):
    cache = self.inner.after_prefill(cache, lengths_B)
    self.samples, self._cand, self._pool, self._step = [], 0.0, 0.0, 0
    self._t, self._compile, self._t_step = time.perf_counter(), self.compile_s, 0
    return self._record(cache, 0)

  def after_step(self, cache):
    cache = self.inner.after_step(cache)
    self._step += 1
    if self._step == 1:  # speed is timed from here: the engine compiles its step before it
      self._t, self._compile, self._t_step = time.perf_counter(), self.compile_s, 1
    return self._record(cache, self._step) if self._step % self.every == 0 else cache

  def stats(self, cache) -> dict:
    pool = self._pool + float(jnp.sum(cache.pool_total_B))
    return {"pool_fraction": (self._cand + float(jnp.sum(cache.cand_total_B))) / pool
            if pool else 0.0}

  def _record(self, cache, step: int):
    cache = jax.block_until_ready(cache)  # host-side readings must follow the dispatched work
    now, compiled = time.perf_counter(), self.compile_s
    elapsed = now - self._t - (compiled - self._compile)
    steps = step - self._t_step
    cand, pool = float(jnp.sum(cache.cand_total_B)), float(jnp.sum(cache.pool_total_B))
    self._cand, self._pool = self._cand + cand, self._pool + pool
    store = getattr(self.inner, "store", None)
    pool_tokens = int(cache.pool_len_B[0])
    mem = read_memory()
    sample = Sample(
        step=step, tokens_per_s=steps / elapsed if steps and elapsed > 0 else float("nan"),
        rss_mb=mem["rss"] / MB, hwm_mb=mem["hwm"] / MB,
        store_mb=store.memory_bytes() / MB if store is not None else 0.0,
        pool_tokens=pool_tokens,
        pool_mb=pool_tokens * pool_token_bytes(store) / MB if store is not None else 0.0,
        attended=cand / pool if pool else float("nan"))
    self.samples.append(sample)
    if self.on_sample:
      self.on_sample(sample)
    self._t, self._compile, self._t_step = time.perf_counter(), self.compile_s, step
    return dataclasses.replace(cache, cand_total_B=jnp.zeros_like(cache.cand_total_B),
                               pool_total_B=jnp.zeros_like(cache.pool_total_B))


def pool_token_bytes(store: HostKVStore) -> int:
  """Store bytes per pool token of one slot, over all its layers and KV heads, from the store's
  own size formula (HostKVStore.estimate_bytes): how one more slot's cost grows per token of
  capacity (differencing over slots leaves out the per-thread scratch)."""
  geometry = {k: getattr(store, k) for k in ("num_layers", "num_kv_heads", "head_dim",
                                             "num_bits", "num_tables", "dtype")}
  est = lambda slots, cap: HostKVStore.estimate_bytes(num_slots=slots, capacity=cap, **geometry)
  return (est(2, 2) - est(1, 2)) - (est(2, 1) - est(1, 1))


def soak(cfg: Config, model, prompt_ids: Sequence[int], new_tokens: int, every: int,
         on_sample: Callable[[Sample], None] | None = None) -> tuple[list[Sample], list[int], dict]:
  """Greedy MagicPIG generation of `new_tokens` after `prompt_ids`, EOS ignored.

  Returns:
    (samples, generated ids, {"pool_fraction", "decode_tokens_per_s", "compile_s"}).
  """
  if cfg.attention.kind != "magicpig":
    raise ValueError(f"A soak runs MagicPIG; got attention.kind={cfg.attention.kind!r}.")
  rec = RecordingBackend(MagicPigBackend(cfg), every, on_sample)
  # Engine.generate stops only where its `stop` callback says so: with none, EOS is ignored.
  ids, _, stats = Engine(cfg, model, rec).generate(
      [list(prompt_ids)], SamplingConfig(max_new_tokens=new_tokens))
  summary = {"pool_fraction": stats.extra["pool_fraction"],
             "decode_tokens_per_s": stats.decode_tokens_per_s, "compile_s": stats.compile_s}
  rec.inner.store.close()
  return rec.samples, ids[0], summary


def compare_with_reference(cfg: Config, model, prompt_ids: Sequence[int],
                           new_tokens: int) -> dict:
  """Greedy tokens of the FFI backend, the pure-jnp reference with the same evictions, and dense
  attention over the same prompt. The store keeps float32 K/V here, as the reference attends
  the float32 keys."""
  cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention,
                                                               store_dtype="float32"))
  sc = SamplingConfig(max_new_tokens=new_tokens)
  backends = {"ffi": MagicPigBackend(cfg),
              "reference": PoolPolicyBackend(cfg, "magicpig", pool_generated=True),
              "dense": PoolPolicyBackend(cfg, "dense")}
  out = {}
  for name, backend in backends.items():
    ids, _, stats = Engine(cfg, model, backend).generate([list(prompt_ids)], sc)
    out[name] = {"tokens": ids[0], "pool_fraction": stats.extra.get("pool_fraction", 0.0)}
  store = backends["ffi"].store
  # Pool tokens beyond the prompt's pool came from evictions of generated_buffer // 2 each.
  prompt_pool = max(len(prompt_ids) - cfg.attention.sink - cfg.attention.window, 0)
  out["evictions"] = (store.num_tokens(0, 0) - prompt_pool) // (cfg.attention.generated_buffer // 2)
  store.close()
  ffi, ref = np.array(out["ffi"]["tokens"]), np.array(out["reference"]["tokens"])
  out["first_mismatch"] = _first_mismatch(ffi, ref)
  out["first_mismatch_vs_dense"] = _first_mismatch(ffi, np.array(out["dense"]["tokens"]))
  out["teacher_forced"] = teacher_forced_agreement(cfg, model, prompt_ids, out["ffi"]["tokens"])
  return out


def teacher_forced_agreement(cfg: Config, model, prompt_ids: Sequence[int],
                             tokens: Sequence[int]) -> dict:
  """Feeds the same tokens to the FFI backend and to the reference with the same evictions and
  compares their next-token log-probabilities at every step. Greedy decoding turns any float
  difference at a near-tie into a different continuation; this measures the difference itself.

  Returns:
    max_abs_logprob_diff over steps and vocabulary; top1_disagreements: steps whose argmax
    differs, with the reference's top-1 minus top-2 log-probability margin there; both
    backends' attended fractions over the same stream (equal when the candidate sets are).
  """
  runner = Runner(cfg, model, chunk=cfg.prefill_chunk)
  n = len(prompt_ids) + len(tokens)
  dense, _ = runner.prefill(np.asarray([prompt_ids], np.int32), -(-(n + 1) // 256) * 256)
  feed = np.asarray([tokens[:-1]], np.int32)  # token t is fed; the step predicts token t + 1
  lps, fractions = {}, {}
  for name, backend in (("ffi", MagicPigBackend(cfg)),
                        ("reference", PoolPolicyBackend(cfg, "magicpig", pool_generated=True))):
    lp, cache = runner.teacher_force(backend, runner.start(backend, dense), feed)
    lps[name], fractions[name] = lp[0], backend.stats(cache)["pool_fraction"]
    if name == "ffi":
      backend.store.close()
  top_f, top_r = lps["ffi"].argmax(-1), lps["reference"].argmax(-1)
  two = np.sort(lps["reference"], axis=-1)[:, -2:]
  return {"steps": len(feed[0]),
          "max_abs_logprob_diff": float(np.abs(lps["ffi"] - lps["reference"]).max()),
          "top1_disagreements": [{"step": int(t), "reference_margin": float(two[t, 1] - two[t, 0])}
                                 for t in np.flatnonzero(top_f != top_r)],
          "pool_fraction": fractions}


def _first_mismatch(a: np.ndarray, b: np.ndarray) -> int | None:
  diff = np.flatnonzero(a != b)
  return int(diff[0]) if len(diff) else None


def growth_after(samples: Sequence[Sample], warmup_step: int) -> dict:
  """Memory growth from the first sample at or after `warmup_step` to the last one, in MB:
  VmRSS, VmHWM (peak), the pool's data, the store's reserved capacity, and VmRSS beyond the pool
  data's growth (what a leak would show in; freed heap from the prefill peak can absorb part of
  the pool's growth, so it may be negative)."""
  later = [s for s in samples if s.step >= warmup_step]
  if len(later) < 2:
    raise ValueError(f"Need two samples at or after step {warmup_step}; have {len(later)}.")
  a, b = later[0], later[-1]
  return {"from_step": a.step, "to_step": b.step, "rss_mb": b.rss_mb - a.rss_mb,
          "hwm_mb": b.hwm_mb - a.hwm_mb, "pool_mb": b.pool_mb - a.pool_mb,
          "store_mb": b.store_mb - a.store_mb,
          "rss_beyond_pool_mb": (b.rss_mb - a.rss_mb) - (b.pool_mb - a.pool_mb)}
