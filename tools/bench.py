"""Decode-speed benchmarks: dense vs MagicPIG at long context, kernel roofline, prefill overhead,
host memory per token, and llama.cpp as a peer (BENCHMARKS.md, "Method"; its tables hold the
results).

Long contexts are built from the real keys and values of a real, shorter prefill (`tile_cache`):
prefilling 128k tokens of a real model on two CPU cores would take hours. Token p of the long
context copies source token src(p) (the first n_src tokens are the prefill itself; later ones
cycle through the source positions [sink, n_src), so the attention-sink tokens appear once) and
its key is rotated by RoPE from position src(p) to p. RoPE rotations compose, R(p) = R(p - src(p))
R(src(p)), so this is exactly "un-rotate at src(p), rotate at p", done as one rotation.

Every dense-vs-MagicPIG comparison times both jitted decode steps in the same process,
interleaved round by round, and reports medians and their ratio.

Shape key: B batch   K kv heads   S cache positions   D head dim   N context tokens
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import _pigjax_devtools  # the build's test and benchmark helpers (xla_ffi/devtools.cc)
from pigjax import _pigjax_ffi, attention, lsh
from pigjax.config import AttentionConfig, ModelConfig, SamplingConfig
from pigjax.attention import DenseBackend
from pigjax.engine import Engine
from pigjax.magicpig import MagicPigBackend, MagicPigCache
from pigjax.model import apply_rope, rope_tables
from pigjax.step import UniformSampler
from pigjax.store import HostKVStore, store_attend, store_insert

GPL = "/usr/share/common-licenses/GPL-3"


# ------------------------------------------------------------------------------------------------
# Machine


def memory_bandwidth(mbytes: int = 512, threads: int = 0, repeats: int = 5) -> dict:
  """STREAM-style copy and read bandwidth (GB/s, best of `repeats`) from the build's C++ helpers.

  copy: b[i] = a[i] over two `mbytes` float arrays, counted as 2 x mbytes moved (STREAM's
  convention). read: a sum over one array (what a gather-heavy kernel mostly does).
  """
  copy, read = _pigjax_devtools.stream_bandwidth(mbytes << 20, threads, repeats)
  return {"copy_gbps": copy, "read_gbps": read, "mbytes": mbytes,
          "threads": threads or os.cpu_count()}


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cpus)"
  except OSError:
    pass
  return f"unknown ({os.cpu_count()} cpus)"


# ------------------------------------------------------------------------------------------------
# Building long caches from a real prefill


def prompt_ids(tokenizer, n: int, path: str = GPL) -> list[int]:
  """n token ids of a real text (repeated if it is shorter)."""
  with open(path) as f:
    text = f.read()
  ids = tokenizer.encode(text)
  while len(ids) < n:
    ids = ids + ids
  return ids[:n]


def real_prefill(engine: Engine, ids: list[int], batch: int = 1) -> tuple[attention.DenseCache,
                                                                          float]:
  """Dense prefill of `ids` (every row the same prompt); returns the cache and the seconds it took
  after compilation."""
  n = len(ids)
  chunk = engine.cfg.prefill_chunk
  cache_len = -(-n // chunk) * chunk
  cache = DenseBackend(engine.cfg).create_cache(batch, cache_len, engine.cache_dtype)
  tokens_BN = np.tile(np.asarray(ids, np.int32), (batch, 1))
  tokens_BN = np.pad(tokens_BN, ((0, 0), (0, cache_len - n)))
  h = jnp.zeros((batch, engine.cfg.model.hidden_size), engine.model.dtype)
  step = engine.programs.get("prefill", engine.core.prefill_chunk, engine.params, cache,
                             jnp.asarray(tokens_BN[:, :chunk]), jnp.zeros((batch,), jnp.int32), h,
                             donate=(1,))
  t0 = time.perf_counter()
  for s in range(0, cache_len, chunk):
    nval = jnp.full((batch,), max(0, min(chunk, n - s)), jnp.int32)
    cache, h = step(engine.params, cache, jnp.asarray(tokens_BN[:, s:s + chunk]), nval, h)
  jax.block_until_ready(cache)
  return cache, time.perf_counter() - t0


def repeat_rows(cache: attention.DenseCache, batch: int) -> attention.DenseCache:
  """A one-row dense cache as `batch` identical rows (batched benchmarks)."""
  if batch == 1:
    return cache
  rep = lambda x: jnp.repeat(x, batch, axis=0)
  return attention.DenseCache(k=tuple(map(rep, cache.k)), v=tuple(map(rep, cache.v)),
                              lengths_B=rep(cache.lengths_B))


def source_positions(n_src: int, n: int, sink: int) -> np.ndarray:
  """src(p) for p < n: p itself for p < n_src, then cycling through [sink, n_src)."""
  p = np.arange(n)
  return np.where(p < n_src, p, sink + (p - n_src) % (n_src - sink)).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("capacity", "model_cfg", "dtype"))
def _tile_layer(k_BKSD, v_BKSD, src_N, delta_N, *, capacity, model_cfg, dtype):
  k = jnp.take(k_BKSD, src_N, axis=2).astype(jnp.float32)
  sin, cos = rope_tables(delta_N[None], model_cfg)  # [1, N, D]
  k = jnp.swapaxes(apply_rope(jnp.swapaxes(k, 1, 2), sin, cos), 1, 2)
  v = jnp.take(v_BKSD, src_N, axis=2)
  pad = ((0, 0), (0, 0), (0, capacity - src_N.shape[0]), (0, 0))
  return jnp.pad(k.astype(dtype), pad), jnp.pad(v.astype(dtype), pad)


def tile_cache(src: attention.DenseCache, n_src: int, n: int, capacity: int,
               model_cfg: ModelConfig, sink: int = 4, dtype=None) -> attention.DenseCache:
  """A dense cache of n tokens (capacity >= n positions) from the first n_src tokens of `src`.

  Keys are re-rotated to their new positions (see the module docstring); values are copied.
  """
  src_N = source_positions(n_src, n, sink)
  delta_N = np.arange(n, dtype=np.int32) - src_N
  dtype = dtype or src.k[0].dtype
  k, v = [], []
  for k_l, v_l in zip(src.k, src.v):
    kt, vt = _tile_layer(k_l[:, :, :n_src], v_l[:, :, :n_src], jnp.asarray(src_N),
                         jnp.asarray(delta_N), capacity=capacity, model_cfg=model_cfg,
                         dtype=jnp.dtype(dtype))
    k.append(kt), v.append(vt)
  B = src.lengths_B.shape[0]
  return attention.DenseCache(k=tuple(k), v=tuple(v), lengths_B=jnp.full((B,), n, jnp.int32))


@functools.partial(jax.jit, static_argnames=("n", "sink", "window", "num_bits", "num_tables"))
def _pool_codes(k_BKSD, w, *, n, sink, window, num_bits, num_tables, block=4096):
  """lsh.centre_and_hash of the pool keys, hashed `block` tokens at a time so that the
  [tokens, num_bits * num_tables] projection stays in cache (same codes, several times faster
  at long context on CPU)."""
  kp = k_BKSD[:, :, sink:n - window].astype(jnp.float32)
  P = kp.shape[2]
  mu = jnp.mean(kp, axis=2)
  pad = -P % block
  kc = jnp.pad(kp - mu[:, :, None], ((0, 0), (0, 0), (0, pad), (0, 0)))
  kc = jnp.moveaxis(kc.reshape(*kc.shape[:2], -1, block, kc.shape[-1]), 2, 0)
  codes = jax.lax.map(lambda x: lsh.hash_codes(x, w, num_bits, num_tables), kc)
  codes = jnp.moveaxis(codes, 0, 2).reshape(*kp.shape[:2], P + pad, num_tables)[:, :, :P]
  return mu, codes


def magicpig_cache(backend: MagicPigBackend, dense: attention.DenseCache, n: int,
                   timings: dict | None = None) -> MagicPigCache:
  """The cache `backend.after_prefill` makes from `dense` (all rows n tokens long), built one
  layer at a time so that peak memory stays one layer's pool; `dense` is left intact.

  timings (optional) receives "hash_s" and "insert_s", summed over sparse layers.
  """
  a, m = backend.cfg.attention, backend.cfg.model
  B = dense.lengths_B.shape[0]
  if n <= a.sink + a.window:
    raise ValueError(f"Context {n} must exceed sink + window = {a.sink + a.window}.")
  for slot in range(B):
    backend.store.reset(slot)
  pos_J = np.concatenate([np.arange(a.sink), n - a.window + np.arange(a.window)]).astype(np.int32)
  exact_pos_BX = np.concatenate([np.tile(pos_J, (B, 1)),
                                 np.full((B, a.generated_buffer), -1, np.int32)], 1)
  pad = ((0, 0), (0, 0), (0, a.generated_buffer), (0, 0))
  slots = jnp.arange(B, dtype=jnp.int32)
  lengths = jnp.full((B,), n - a.sink - a.window, jnp.int32)
  k, v, mu, w = [], [], [], []
  out_len = jnp.zeros((B,), jnp.int32)
  t_hash = t_insert = 0.0
  for layer in range(m.num_layers):
    if layer not in backend.store_index:
      k.append(jnp.copy(dense.k[layer])), v.append(jnp.copy(dense.v[layer]))
      mu.append(None), w.append(None)
      continue
    k_l, v_l = dense.k[layer], dense.v[layer]
    k.append(jnp.pad(k_l[:, :, pos_J], pad)), v.append(jnp.pad(v_l[:, :, pos_J], pad))
    w_l = backend.estimator.layer_matrix(layer)  # None for the proxy estimator: nothing to hash
    t0 = time.perf_counter()
    if w_l is None:
      kp_f = k_l[:, :, a.sink:n - a.window].astype(jnp.float32)
      mu_l = jax.block_until_ready(jnp.mean(kp_f, axis=2))
      codes = jnp.zeros(kp_f.shape[:3] + (0,), jnp.int32)
      del kp_f
    else:
      mu_l, codes = jax.block_until_ready(_pool_codes(
          k_l, w_l, n=n, sink=a.sink, window=a.window, num_bits=a.num_bits,
          num_tables=a.num_tables))
    t1 = time.perf_counter()
    kp, vp = k_l[:, :, a.sink:n - a.window], v_l[:, :, a.sink:n - a.window]
    jax.block_until_ready((kp, vp))
    t2 = time.perf_counter()
    out_len = jnp.maximum(out_len, jax.block_until_ready(store_insert(
        backend.store.handle, backend.store_index[layer], slots, kp, vp, codes, lengths, mu_l)))
    t_hash += t1 - t0
    t_insert += time.perf_counter() - t2
    del kp, vp, codes
    mu.append(mu_l), w.append(w_l)
  if timings is not None:
    timings.update(hash_s=t_hash, insert_s=t_insert)
  return MagicPigCache(
      k=tuple(k), v=tuple(v), lengths_B=jnp.full((B,), n, jnp.int32),
      exact_pos_BX=jnp.asarray(exact_pos_BX), gen_count_B=jnp.zeros((B,), jnp.int32),
      mu=tuple(mu), w=tuple(w), pool_len_B=out_len, handle=jnp.int32(backend.store.handle),
      cand_total_B=jnp.zeros((B,), jnp.float32), pool_total_B=jnp.zeros((B,), jnp.float32))


# ------------------------------------------------------------------------------------------------
# Timing


def with_rope_scaling(pipe, factor: float):
  """pipe's Config with its model run at Llama-3.1 ("llama3") RoPE scaling by `factor` over the
  checkpoint's trained context (ModelConfig.rope_original_max_position), the model's config set
  to match; factor 0 leaves the checkpoint's RoPE. How one runs a model past the context it was
  trained on: without it, keys at distances past that context rotate to angles the model never
  saw, and MagicPIG's collisions there grow (BENCHMARKS.md, "Method")."""
  if factor < 0:
    raise ValueError(f"rope_scaling_factor must be >= 0 (0 = the checkpoint's RoPE), got {factor}")
  if not factor:
    return pipe.cfg
  if pipe.model.cfg.rope_scaling_factor:
    raise ValueError("the model already scales its RoPE "
                     f"(factor {pipe.model.cfg.rope_scaling_factor}); not scaling it again")
  model_cfg = dataclasses.replace(pipe.model.cfg, rope_scaling_factor=float(factor))
  pipe.model.cfg = model_cfg
  return dataclasses.replace(pipe.cfg, model=model_cfg)


def decode_stepper(engine: Engine, cache, batch: int, history_len: int) -> Callable[[], float]:
  """A function that runs one jitted greedy decode step on `cache` (donated and carried) and
  returns its wall time in seconds (compilation happens here, before the first timed call)."""
  sc = SamplingConfig(max_new_tokens=2)
  key = jax.random.key(0)
  hist = jnp.full((batch, history_len), -1, jnp.int32)
  tok = jnp.zeros((batch,), jnp.int32)
  sampler = UniformSampler(sc)
  step = engine.programs.get("decode", functools.partial(engine.core.decode_step, sampler=sampler),
                             engine.params, cache, tok, key, hist, donate=(1,), static=(sampler,))
  state = {"cache": cache, "tok": tok}

  def run() -> float:
    t0 = time.perf_counter()
    tok, c = step(engine.params, state["cache"], state["tok"], key, hist)
    jax.block_until_ready(tok)
    dt = time.perf_counter() - t0
    state["cache"] = engine.backend.after_step(c)
    state["tok"] = tok
    return dt

  run.state = state
  return run


def interleaved(fns: dict[str, Callable[[], float]], rounds: int, steps: int,
                warmup: int = 1) -> dict[str, list[float]]:
  """Runs each timed function `steps` times per round, alternating between them for `rounds`
  rounds (so machine noise hits all alike); returns each one's step times."""
  for f in fns.values():
    for _ in range(warmup):
      f()
  out = {name: [] for name in fns}
  for _ in range(rounds):
    for name, f in fns.items():
      out[name].extend(f() for _ in range(steps))
  return out


def summarise(times: dict[str, list[float]], batch: int = 1) -> dict:
  med = {k: statistics.median(v) for k, v in times.items()}
  res = {f"{k}_ms": 1e3 * m for k, m in med.items()}
  res.update({f"{k}_tok_s": batch / m for k, m in med.items()})
  res.update({f"{k}_iqr_ms": 1e3 * float(np.subtract(*np.percentile(v, [75, 25])))
              for k, v in times.items()})
  return res


# ------------------------------------------------------------------------------------------------
# Kernel profile and host memory


def kernel_profile(store: HostKVStore) -> dict:
  """The store's kernel counters since the last reset (profiling must be on)."""
  return dict(_pigjax_ffi.store_profile(store.handle))


def candidate_slices(prof: dict, pool: int) -> list[float]:
  """From kernel_profile's counters: the fraction of each of the pool's 16 equal slices (oldest
  tokens first) that a query head attends, averaged over the profiled heads."""
  bins = np.asarray(prof["candidate_bins"], np.float64)
  return [float(x) for x in bins / max(1, prof["heads"]) / (pool / len(bins))]


def set_profiling(store: HostKVStore, on: bool) -> None:
  _pigjax_ffi.store_set_profiling(store.handle, on)


def host_bytes_per_token(head_dim: int, num_tables: int, dtype: str = "bfloat16") -> dict:
  """Host bytes per pool token per KV head: pigjax's layout and the original MagicPIG's.

  pigjax: one row per token, K then V in `dtype`, padded to 16 bytes (|k - mu| is recomputed
  from the row in the kernel; int8 rows keep their two f32 scales in a side array); and a 16-bit
  id per table (the tables come in segments of 2^16 tokens, xla_ffi/lsh_tables.h TableSegment). Each
  segment's CSR offsets (L x (2^K + 1) int32) are per segment, not per token. The original keeps
  bf16 K and V, int32 ids per table and f32 norms (its `hash_table` / `key_norm` tensors).
  """
  kv = 2 * head_dim * jnp.dtype(dtype).itemsize
  ours = {"k_v": -(-kv // 16) * 16, "scales": 8 if dtype == "int8" else 0,
          "tables": 2 * num_tables}
  ours["total"] = sum(ours.values())
  orig = {"k_v": 2 * head_dim * 2, "norm": 4, "tables": 4 * num_tables}
  orig["total"] = sum(orig.values())
  return {"pigjax": ours, "original": orig}


# ------------------------------------------------------------------------------------------------
# Attention-only configuration (Llama-3.1-8B head shapes)


def synthetic_kv(key, batch: int, num_kv_heads: int, n: int, head_dim: int, capacity: int,
                 dtype=jnp.float32):
  """Gaussian keys with a shared per-head offset (post-RoPE keys of real models have a large
  mean, which is why MagicPIG centres them) and Gaussian values, padded to `capacity`."""
  k1, k2, k3 = jax.random.split(key, 3)
  mean = 2.0 * jax.random.normal(k1, (1, num_kv_heads, 1, head_dim))
  k = jax.random.normal(k2, (batch, num_kv_heads, capacity, head_dim)) + mean
  v = jax.random.normal(k3, (batch, num_kv_heads, capacity, head_dim))
  valid = (jnp.arange(capacity) < n)[None, None, :, None]
  return jnp.where(valid, k, 0).astype(dtype), jnp.where(valid, v, 0).astype(dtype)


def attention_only_steps(num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                         n: int, batch: int, num_bits: int, num_tables: int, sink: int = 4,
                         window: int = 64, threads: int = 0, seed: int = 0,
                         store_dtype: str = AttentionConfig.store_dtype):
  """Jitted attention-only decode steps over `num_layers` layers of synthetic keys: dense
  (attend over an f32 cache of n tokens) and MagicPIG (exact sink + window part in JAX, the pool
  in a host store, log-sum-exp merge). Returns ({"dense": fn, "magicpig": fn}, store, info)."""
  capacity = n + 256
  key = jax.random.key(seed)
  caches = [synthetic_kv(jax.random.fold_in(key, l), batch, num_kv_heads, n, head_dim, capacity)
            for l in range(num_layers)]
  store = HostKVStore(num_layers=num_layers, num_slots=batch, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, num_bits=num_bits, num_tables=num_tables, capacity=n,
                      dtype=store_dtype, threads=threads, verbose=False)
  slots = jnp.arange(batch, dtype=jnp.int32)
  exact_idx = np.concatenate([np.arange(sink), n - window + np.arange(window)])
  ws, mus, exact = [], [], []
  dep = jnp.zeros((batch,), jnp.int32)
  for l, (k, v) in enumerate(caches):
    w = lsh.simhash_matrix(seed, l, head_dim, num_bits, num_tables)
    mu, codes = _pool_codes(k, w, n=n, sink=sink, window=window, num_bits=num_bits,
                            num_tables=num_tables)
    dep = jnp.maximum(dep, store_insert(store.handle, l, slots, k[:, :, sink:n - window],
                                        v[:, :, sink:n - window], codes,
                                        jnp.full((batch,), n - sink - window, jnp.int32), mu))
    ws.append(w), mus.append(mu), exact.append((k[:, :, exact_idx], v[:, :, exact_idx]))
  jax.block_until_ready(dep)
  visible = (jnp.arange(capacity) < n)[None, None, :]

  @jax.jit
  def dense(q_BHD, kv):
    outs = [attention.attend_with_lse(q_BHD[:, None], k, v, visible)[0] for k, v in kv]
    return sum(outs)

  @functools.partial(jax.jit, static_argnames=())
  def sparse(q_BHD, ex, ws, dep):
    total = 0.
    for l, ((k, v), w) in enumerate(zip(ex, ws)):
      o_ex, lse_ex = attention.attend_with_lse(q_BHD[:, None], k, v,
                                               jnp.ones((batch, 1, k.shape[2]), bool))
      codes = lsh.hash_codes(q_BHD, w, num_bits, num_tables)
      o_p, lse_p, _ = store_attend(store.handle, l, slots, q_BHD, codes, dep)
      o, _ = attention.merge_attention(o_ex[:, 0], lse_ex[:, 0], o_p, lse_p)
      total = total + o
    return total

  qs = iter(jax.random.normal(jax.random.fold_in(key, 10**6 + i), (batch, num_heads, head_dim))
            for i in range(10**6))
  # Queries with the keys' mean direction, like real queries that attend to the sink strongly.
  fns = {}

  def timed(f, *args):
    def run():
      q = next(qs)
      jax.block_until_ready(q)
      t0 = time.perf_counter()
      jax.block_until_ready(f(q, *args))
      return time.perf_counter() - t0
    return run

  fns["dense"] = timed(dense, caches)
  fns["magicpig"] = timed(sparse, exact, ws, dep)
  info = {"dense_bytes": num_layers * 2 * batch * num_kv_heads * capacity * head_dim * 4}
  return fns, store, info


# ------------------------------------------------------------------------------------------------
# llama.cpp peer


class LlamaCppPeer:
  """llama.cpp (llama-cpp-python) dense decoding of a GGUF at a given context, same cores.

  The context is filled by evaluating real prompt tokens once per length (llama.cpp's own
  prefill, not timed); decode steps are then timed one token at a time.
  """

  def __init__(self, gguf_path: str, n_ctx: int, threads: int):
    import llama_cpp  # optional: pip install llama-cpp-python (the `bench` extra)
    self.llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads,
                               n_threads_batch=threads, n_batch=512, verbose=False)
    self.n = 0

  def fill(self, ids: list[int]) -> float:
    self.llm.reset()
    t0 = time.perf_counter()
    self.llm.eval(ids)
    self.n = len(ids)
    return time.perf_counter() - t0

  def stepper(self, token: int = 13) -> Callable[[], float]:
    def run() -> float:
      t0 = time.perf_counter()
      self.llm.eval([token])
      return time.perf_counter() - t0
    return run


# ------------------------------------------------------------------------------------------------
# Figures


def plot_results(res: dict, out_dir: str) -> list[str]:
  """Latency vs context, speedup vs context and roofline fraction from a bench_decode.py JSON;
  returns the PNG paths written."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  os.makedirs(out_dir, exist_ok=True)
  rows = [r for r in res.get("smollm2", []) if "skipped" not in r and r.get("batch", 1) == 1]
  cpp = [r for r in res.get("llamacpp", []) if isinstance(r, dict) and "llamacpp_ms" in r]
  paths = []
  ctx = [r["context"] / 1024 for r in rows]

  fig, ax = plt.subplots(figsize=(5, 3.5))
  ax.plot(ctx, [r["dense_ms"] for r in rows], "o-", label="pigjax dense")
  ax.plot(ctx, [r["magicpig_ms"] for r in rows], "s-", label="pigjax MagicPIG (10,150)")
  if cpp:
    ax.plot([r["context"] / 1024 for r in cpp], [r["llamacpp_ms"] for r in cpp], "^-",
            label="llama.cpp dense (Q4_1)")
  ax.set(xscale="log", yscale="log", xlabel="context (k tokens)", ylabel="decode step (ms)",
         title="SmolLM2-135M decode step, batch 1")
  ax.legend(fontsize=8), ax.grid(alpha=.3)
  paths.append(os.path.join(out_dir, "latency.png"))
  fig.tight_layout(), fig.savefig(paths[-1], dpi=90), plt.close(fig)

  fig, ax = plt.subplots(figsize=(5, 3.5))
  ax.plot(ctx, [r["speedup"] for r in rows], "o-", label="SmolLM2-135M, full step")
  l8 = res.get("llama8b_attention", [])
  if l8:
    ax.plot([r["context"] / 1024 for r in l8], [r["speedup"] for r in l8], "s-",
            label="Llama-3.1-8B shapes, attention only")
  ax.axhline(1, color="gray", lw=.8)
  ax.set(xscale="log", xlabel="context (k tokens)", ylabel="dense / MagicPIG step time",
         title="MagicPIG speedup over dense")
  ax.legend(fontsize=8), ax.grid(alpha=.3)
  paths.append(os.path.join(out_dir, "speedup.png"))
  fig.tight_layout(), fig.savefig(paths[-1], dpi=90), plt.close(fig)

  bw = 0.5 * (res["bandwidth"]["read_gbps"] + res.get("bandwidth_end", res["bandwidth"])["read_gbps"])
  fig, ax = plt.subplots(figsize=(5, 3.5))
  ax.plot(ctx, [r["kernel_bytes_per_step"] / r["kernel_ms_per_step"] * 1e-6 / bw for r in rows],
          "o-", label="attend kernel, bytes it must read / time")
  ax.axhline(0.5, color="gray", ls="--", lw=.8, label="target 50%")
  ax.set(xscale="log", ylim=(0, 1), xlabel="context (k tokens)",
         ylabel="fraction of measured read bandwidth", title="Attend kernel roofline")
  ax.legend(fontsize=8), ax.grid(alpha=.3)
  paths.append(os.path.join(out_dir, "roofline.png"))
  fig.tight_layout(), fig.savefig(paths[-1], dpi=90), plt.close(fig)
  return paths


def markdown_tables(res: dict) -> str:
  """The result tables of BENCHMARKS.md from a bench_decode.py JSON."""
  bw0, bw1 = res["bandwidth"], res.get("bandwidth_end", res["bandwidth"])
  read_bw = 0.5 * (bw0["read_gbps"] + bw1["read_gbps"])
  out = [f"CPU: {res['cpu']}. Memory bandwidth (C++ STREAM-style, {bw0['threads']} threads, "
         f"start / end of run): copy {bw0['copy_gbps']:.1f} / {bw1['copy_gbps']:.1f} GB/s, "
         f"read {bw0['read_gbps']:.1f} / {bw1['read_gbps']:.1f} GB/s.", ""]
  out += ["| context | batch | dense ms | MagicPIG ms | speedup | dense tok/s | MagicPIG tok/s | "
          "dense cache | kernel ms/step | kernel MB/step | kernel GB/s | % of read BW | lookup / "
          "score / softmax worker ms | candidates |", "|" + "---|" * 14]
  for r in res.get("smollm2", []):
    if "skipped" in r:
      out.append(f"| {r['context']} | {r.get('batch', 1)} | skipped: {r['skipped']} |" + " |" * 11)
      continue
    gbps = r["kernel_bytes_per_step"] / r["kernel_ms_per_step"] * 1e-6
    out.append(
        f"| {r['context']} | {r.get('batch', 1)} | {r['dense_ms']:.0f} | {r['magicpig_ms']:.0f} | "
        f"{r['speedup']:.2f}x | {r['dense_tok_s']:.2f} | {r['magicpig_tok_s']:.2f} | "
        f"{r.get('dense_cache_dtype', 'float32')} | {r['kernel_ms_per_step']:.0f} | "
        f"{r['kernel_bytes_per_step'] / 1e6:.0f} | {gbps:.1f} | {100 * gbps / read_bw:.0f}% | "
        f"{r['lookup_ms']:.0f} / {r['score_ms']:.0f} / {r['softmax_ms']:.0f} | "
        f"{100 * r['candidate_fraction']:.1f}% |")
  l8 = res.get("llama8b_attention", [])
  if l8:
    out += ["", "| context | layers | dense attention ms | MagicPIG attention ms | speedup | "
            "kernel ms | kernel MB | candidates |", "|" + "---|" * 8]
    for r in l8:
      out.append(f"| {r['context']} | {r['layers']} | {r['dense_ms']:.1f} | "
                 f"{r['magicpig_ms']:.1f} | {r['speedup']:.2f}x | {r['kernel_ms_per_step']:.1f} |"
                 f" {r['kernel_bytes_per_step'] / 1e6:.1f} | "
                 f"{100 * r['candidate_fraction']:.1f}% |")
  cpp = res.get("llamacpp")
  if isinstance(cpp, list) and cpp:
    out += ["", "| context | llama.cpp step ms (median) | IQR ms | tok/s | fill s |",
            "|---|---|---|---|---|"]
    for r in cpp:
      out.append(f"| {r['context']} | {r['llamacpp_ms']:.0f} | {r['llamacpp_iqr_ms']:.0f} | "
                 f"{r['llamacpp_tok_s']:.1f} | {r['fill_s']:.0f} |")
  elif isinstance(cpp, dict):
    out += ["", f"llama.cpp: {cpp.get('error')}"]
  p = res.get("prefill")
  if p:
    out += ["", f"Prefill overhead: dense prefill of {p['tokens']} real tokens "
            f"{p['dense_prefill_s']:.1f} s ({p['dense_per_1k_tokens_s']:.2f} s per 1k tokens); "
            f"MagicPigBackend.after_prefill (centre + hash + insert, all sparse layers) "
            f"{p['after_prefill_s']:.2f} s ({p['per_1k_tokens_s']:.2f} s per 1k tokens, of which "
            f"the C++ insert {p['insert_kernel_s']:.2f} s) = {100 * p['overhead']:.1f}% of the "
            f"dense prefill."]
  return "\n".join(out)
