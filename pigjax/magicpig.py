"""MagicPIG decoding: exact attention over sink + window + generated tokens on the device, LSH-sampled
attention over the pool in the host KV store (docs/design.md, "The algorithm" and "The host store").

Prefill is dense (every layer keeps a full cache while the prompt is read). `after_prefill` then,
for every sparse layer, centres and hashes the pool keys in JAX and hands them to the host store
with the FFI `insert`, and keeps only the exact tokens on the device. Each decode step hashes the
query, calls the FFI `attend` per sparse layer, runs exact attention over the exact buffer and
merges the two by log-sum-exp, all inside the one jitted step. When the generated-token buffer
fills, its older half is hashed (with the pool's mean key) and appended to the pool, so device
memory and step time stay bounded in long generations. On a device mesh (`pigjax.sharding`) each
device inserts and attends inside `shard_map`, on a host store of its own rows and KV heads.

With attention.estimator="proxy" (docs/design.md, "Estimators") the same backend runs the store's
proxy estimator: nothing is hashed (the codes operands have 0 columns); the store quantizes the
centred pool keys into its index at insert (appended generated keys with the pool's first
statistics, clamped) and its attend returns the same (o, lse, count) over the pool, so the merge
is unchanged.

Shape key:
  B batch   T tokens in this call   S dense cache positions   X exact-buffer entries
  H query heads   K kv heads   D head dim   L hash tables   P pool tokens of this call
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pigjax import attention, estimators, host_attention, lsh, placement
from pigjax.config import Config, validate_attention
from pigjax.sharding import Sharding, mesh_requested
from pigjax.store import HostKVStore, proxy_index_bytes, store_insert


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MagicPigCache:
  k: tuple  # per layer: dense [B, K, S, D]; sparse: exact buffer [B, K, X, D]
  v: tuple
  lengths_B: jax.Array  # int32 tokens seen per slot (prompt + generated)
  exact_pos_BX: jax.Array  # int32 position of each exact-buffer entry, -1 if empty
  gen_count: jax.Array  # int32 scalar: generated tokens currently in the exact buffer
  mu: tuple  # per layer: sparse [B, K, D] pool mean key; dense None
  w: tuple  # per layer: sparse SimHash matrix [D, num_bits * num_tables]; dense or proxy None
  pool_len_B: jax.Array  # int32 pool tokens per slot (FFI insert's output: orders attends)
  handle: jax.Array  # int32 scalar: the host store
  cand_total: jax.Array  # f32: candidates attended, summed over steps, sparse layers, heads
  pool_total: jax.Array  # f32: pool tokens available, summed likewise


class MagicPigBackend:
  """Attention backend for `pigjax.engine.Engine` with a host-resident, LSH-indexed pool."""

  def __init__(self, cfg: Config):
    a, m = cfg.attention, cfg.model
    validate_attention(a, m.num_layers)
    if a.estimator not in ("magicpig", "proxy"):
      raise ValueError(
          f"attention.estimator={a.estimator!r} has no host kernel: the FFI store runs "
          "'magicpig' and 'proxy'. Evaluate other estimators in the pure-jnp reference "
          "(scripts/eval_quality.py, pigjax.eval.policies).")
    self.proxy = a.estimator == "proxy"
    placement.place_for("magicpig")  # the host store's FFI calls are CPU-only
    self.cfg = cfg
    self.host_decode = host_attention.use_host_kernel(cfg)  # dense layers' decode attention
    self.sparse_layers = [l for l in range(m.num_layers) if l not in set(a.dense_layers)]
    self.store_index = {l: i for i, l in enumerate(self.sparse_layers)}
    if self.proxy and mesh_requested(cfg.mesh):
      raise ValueError("attention.estimator='proxy' runs on one device (its store is not tested "
                       "under shard_map yet); on a mesh use estimator='magicpig' or "
                       "attention.kind='dense'.")
    self.sharding = Sharding.create(cfg.mesh, m)
    # Host stores by (data, model) mesh coordinate: one, at (0, 0), without a mesh.
    self.stores: dict[tuple[int, int], HostKVStore] = {}
    self._jitted: dict[Any, Any] = {}
    self.compile_s = 0.0  # ahead-of-time compilation of the store-maintenance programs

  # -- cache lifecycle ----------------------------------------------------------------------

  def create_cache(self, batch: int, max_len: int, dtype) -> attention.DenseCache:
    """Prefill runs densely; the store is (re)sized here for this batch and length.

    Under a mesh every device of this process gets its own store for its slots and KV heads.
    """
    m = self.cfg.model
    if self.sparse_layers:
      sh = self.sharding
      if batch % sh.data:
        raise ValueError(f"A batch of {batch} rows does not split over mesh.data={sh.data} "
                         f"devices; give a multiple of {sh.data} prompts.")
      coords = sh.local_coords() if sh.active else [(0, 0)]
      for coord in coords:
        s = self.stores.get(coord)
        if s is None or s.num_slots < batch // sh.data or s.capacity < max_len:
          if s is not None:
            s.close()
          self.stores[coord] = self._new_store(batch // sh.data, m.num_kv_heads // sh.model,
                                               max_len)
        for slot in range(batch // sh.data):
          self.stores[coord].reset(slot)
    return attention.DenseCache.create(m.num_layers, batch, m.num_kv_heads, max_len, m.head_dim,
                                       dtype)

  def _new_store(self, slots: int, kv_heads: int, capacity: int) -> HostKVStore:
    a, m = self.cfg.attention, self.cfg.model
    return HostKVStore(
        num_layers=len(self.sparse_layers), num_slots=slots, num_kv_heads=kv_heads,
        head_dim=m.head_dim, num_bits=a.num_bits, num_tables=a.num_tables, capacity=capacity,
        dtype=a.store_dtype, threads=a.threads, estimator=a.estimator,
        proxy_bits=a.proxy_bits, proxy_fraction=a.proxy_fraction, proxy_tail=a.proxy_tail)

  @property
  def store(self) -> HostKVStore | None:
    """The host store of a one-device run (each device's is in `stores` under a mesh)."""
    return self.stores.get((0, 0))

  @store.setter
  def store(self, store: HostKVStore) -> None:
    self.stores[(0, 0)] = store

  def _handle(self) -> jax.Array:
    """The store handle operand: a scalar, or [data, model] (one per device) under a mesh."""
    if self.sharding.active and self.sparse_layers:
      return self.sharding.handles({c: s.handle for c, s in self.stores.items()})
    return jnp.int32(self.store.handle if self.store is not None else -1)

  def after_prefill(self, cache: attention.DenseCache, lengths_B: np.ndarray) -> MagicPigCache:
    handle = self._handle()
    with warnings.catch_warnings():
      # Donation lets dense layers keep their caches in place; the sparse layers' full caches are
      # freed rather than reused, which jax reports as "not usable".
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      # Block: host-side store calls (num_tokens, reset) are not ordered after dispatched work.
      return jax.block_until_ready(self._compiled("prefill", self._split_prefill, cache, handle))

  def after_step(self, cache: MagicPigCache) -> MagicPigCache:
    """Between decode steps: move the older half of a full generated buffer into the pool."""
    if int(cache.gen_count) < self.cfg.attention.generated_buffer:
      return cache
    return self._compiled("evict", self._evict, cache)

  def _compiled(self, name: str, fn, cache, *args):
    """Runs fn (donating the cache), compiling it ahead of time so compile time is accounted
    separately from run time (`compile_s`, which the engine reports)."""
    leaves, treedef = jax.tree.flatten((cache, args))
    key = (name, treedef, tuple((x.shape, x.dtype) for x in leaves))
    if key not in self._jitted:
      t0 = time.perf_counter()
      self._jitted[key] = jax.jit(fn, donate_argnums=(0,)).lower(cache, *args).compile()
      self.compile_s += time.perf_counter() - t0
    return self._jitted[key](cache, *args)

  def stats(self, cache) -> dict:
    """pool_fraction: pool rows read (magicpig: candidates; proxy: the exact top rows) over pool
    rows available. The proxy also scans its index: index_bytes_per_token per pool token and KV
    head, every step (the estimator's lookup cost, next to the rows it reads)."""
    extra = {}
    if self.proxy:
      extra["index_bytes_per_token"] = proxy_index_bytes(self.cfg.attention.proxy_bits,
                                                         self.cfg.model.head_dim)
    if not isinstance(cache, MagicPigCache) or float(cache.pool_total) == 0:
      return {"pool_fraction": 0.0, **extra}
    return {"pool_fraction": float(cache.cand_total) / float(cache.pool_total), **extra}

  # -- attention ----------------------------------------------------------------------------

  prefill_attend = staticmethod(attention.dense_attend)

  def decode_attend(self, layer: int, q_BTHD, k_BTKD, v_BTKD, cache: MagicPigCache):
    if layer not in self.store_index:
      return attention.dense_attend(layer, q_BTHD, k_BTKD, v_BTKD, cache,
                                    host=self.host_decode)
    a = self.cfg.attention
    B, _, H, D = q_BTHD.shape
    x_new = a.sink + a.window + cache.gen_count
    # The barrier materialises each written buffer once: without it XLA:CPU duplicates the
    # update into both of its users (the attention below and the returned cache), and each
    # duplicate copies the whole buffer first (8 copies of [B, K, X, D] per layer and step).
    k, v = jax.lax.optimization_barrier((_write_at(cache.k[layer], k_BTKD, x_new),
                                         _write_at(cache.v[layer], v_BTKD, x_new)))
    exact_pos_BX = cache.exact_pos_BX.at[:, x_new].set(cache.lengths_B)
    o_BHD, count_BH = self._exact_and_pool(layer, q_BTHD, k, v, exact_pos_BX, cache)
    cache = dataclasses.replace(
        cache, k=attention.replace_at(cache.k, layer, k), v=attention.replace_at(cache.v, layer, v),
        exact_pos_BX=exact_pos_BX,
        cand_total=cache.cand_total + jnp.sum(count_BH, dtype=jnp.float32),
        pool_total=cache.pool_total + H * jnp.sum(cache.pool_len_B, dtype=jnp.float32))
    # gen_count advances once per step, after the last sparse layer.
    if layer == self.sparse_layers[-1]:
      cache = dataclasses.replace(cache, gen_count=cache.gen_count + 1)
    return o_BHD[:, None].astype(q_BTHD.dtype), cache

  def _exact_and_pool(self, layer: int, q_BTHD, k_BKXD, v_BKXD, exact_pos_BX, cache):
    """Exact attention over the buffer (sink, window, generated) merged with the store's
    estimate over the pool; returns o [B, H, D] and the candidates counted per row and head."""
    a = self.cfg.attention
    q_BHD = q_BTHD[:, 0]
    if self.host_decode:  # the host kernel: XLA ran this small masked attention as ~10 ops
      o_ex_BHD, lse_ex_BH = host_attention.decode_attend_masked(q_BHD, k_BKXD, v_BKXD,
                                                                exact_pos_BX >= 0)
    else:
      o_ex_BTHD, lse_ex_BTH = attention.attend_with_lse(q_BTHD, k_BKXD, v_BKXD,
                                                        (exact_pos_BX >= 0)[:, None])
      o_ex_BHD, lse_ex_BH = o_ex_BTHD[:, 0], lse_ex_BTH[:, 0]
    if self.proxy:  # the proxy store scans its index: no codes
      qcodes_BHL = jnp.zeros(q_BHD.shape[:2] + (0,), jnp.int32)
    else:
      qcodes_BHL = lsh.hash_codes(q_BHD, cache.w[layer], a.num_bits, a.num_tables)
    o_pool_BHD, lse_pool_BH, count_BH = self.sharding.store_attend(
        cache.handle, self.store_index[layer], q_BHD, qcodes_BHL, cache.pool_len_B)
    o_BHD, _ = lsh.merge_attention(o_ex_BHD, lse_ex_BH, o_pool_BHD, lse_pool_BH)
    return o_BHD, count_BH

  # -- jitted host-store maintenance --------------------------------------------------------

  def _hash_matrix(self, layer: int):
    """The layer's SimHash matrix; None for the proxy estimator, which hashes nothing."""
    a, m = self.cfg.attention, self.cfg.model
    if self.proxy:
      return None
    return lsh.simhash_matrix(a.seed, layer, m.head_dim, a.num_bits, a.num_tables,
                              a.per_layer_hash)

  def _centre_and_hash(self, k_BKTD, valid_BKT, w):
    """(mu_BKD, codes_BKTL) of a new pool: the proxy store needs only mu (0 code columns)."""
    a = self.cfg.attention
    if self.proxy:
      return (estimators.pool_mean_values(k_BKTD, valid_BKT),
              jnp.zeros(k_BKTD.shape[:3] + (0,), jnp.int32))
    return lsh.centre_and_hash(k_BKTD, valid_BKT, w, a.num_bits, a.num_tables)

  def _append_codes(self, k_BKTD, mu_BKD, w):
    """Codes of keys appended to a pool with mean mu_BKD (0 columns for the proxy)."""
    a = self.cfg.attention
    if self.proxy:
      return jnp.zeros(k_BKTD.shape[:3] + (0,), jnp.int32)
    return lsh.hash_codes(k_BKTD.astype(jnp.float32) - mu_BKD[:, :, None], w, a.num_bits,
                          a.num_tables)

  def _split_prefill(self, dense: attention.DenseCache, handle, slots_B=None) -> MagicPigCache:
    """Keeps exact tokens on the device and inserts each sparse layer's pool into the store
    (row b into store slot slots_B[b]; by default slot b)."""
    a, m = self.cfg.attention, self.cfg.model
    B = dense.lengths_B.shape[0]
    custom_slots = slots_B is not None
    if custom_slots and self.sharding.active:
      raise ValueError("Inserting rows into chosen store slots (serving) is not supported under "
                       "a device mesh; use mesh.data = mesh.model = 1.")
    n_B = dense.lengths_B
    exact = a.sink + a.window
    # Exact-buffer entry j < sink + window holds prompt position pos[b, j].
    j = jnp.arange(exact)
    short_B1 = (n_B <= exact)[:, None]
    pos_BJ = jnp.where(short_B1, j[None], jnp.where(j[None] < a.sink, j[None],
                                                    n_B[:, None] - a.window + (j[None] - a.sink)))
    valid_BJ = pos_BJ < n_B[:, None]
    pos_BJ = jnp.where(valid_BJ, pos_BJ, -1)
    exact_pos_BX = jnp.concatenate([pos_BJ, jnp.full((B, a.generated_buffer), -1, jnp.int32)], 1)
    # Pool: prompt positions [sink, n - window) when the prompt is longer than sink + window.
    pool_len_B = jnp.where(short_B1[:, 0], 0, n_B - exact).astype(jnp.int32)
    S = dense.max_len
    P = max(S - exact, 1)
    pool_idx_P = jnp.arange(P) + a.sink
    pool_valid_BP = jnp.arange(P)[None] < pool_len_B[:, None]

    k, v, mu, w = [], [], [], []
    out_len_B = jnp.zeros((B,), jnp.int32)
    for layer in range(m.num_layers):
      if layer not in self.store_index:
        k.append(dense.k[layer]), v.append(dense.v[layer]), mu.append(None), w.append(None)
        continue
      # One sparse layer at a time: the barrier makes this layer's keys (and so its hashing)
      # wait for the previous layer's insert. Without it XLA schedules every layer's hashing
      # before the first insert, and each layer's f32 projection [B, K, P, num_bits*num_tables]
      # (55 MB for SmolLM2 at 3k tokens) is alive at once: 1.5 GB at the peak.
      k_BKSD, v_BKSD, out_len_B = jax.lax.optimization_barrier(
          (dense.k[layer], dense.v[layer], out_len_B))
      gather = lambda x_BKSD, idx_BJ: jnp.take_along_axis(
          x_BKSD, jnp.maximum(idx_BJ, 0)[:, None, :, None], axis=2)
      pad = ((0, 0), (0, 0), (0, a.generated_buffer), (0, 0))
      k.append(jnp.pad(gather(k_BKSD, pos_BJ), pad))
      v.append(jnp.pad(gather(v_BKSD, pos_BJ), pad))
      w_l = self._hash_matrix(layer)
      kp_BKPD = jnp.take(k_BKSD, jnp.minimum(pool_idx_P, S - 1), axis=2)
      vp_BKPD = jnp.take(v_BKSD, jnp.minimum(pool_idx_P, S - 1), axis=2)
      valid_BKP = jnp.broadcast_to(pool_valid_BP[:, None], kp_BKPD.shape[:3])
      mu_BKD, codes_BKPL = self._centre_and_hash(kp_BKPD, valid_BKP, w_l)
      # Every insert feeds pool_len_B, which every later attend takes as its ordering operand.
      if custom_slots:
        inserted_B = store_insert(handle, self.store_index[layer], slots_B, kp_BKPD, vp_BKPD,
                                  codes_BKPL, pool_len_B, mu_BKD)
      else:
        inserted_B = self.sharding.store_insert(handle, self.store_index[layer], kp_BKPD,
                                                vp_BKPD, codes_BKPL, pool_len_B, mu_BKD)
      out_len_B = jnp.maximum(out_len_B, inserted_B)
      mu.append(mu_BKD), w.append(w_l)
    return self.sharding.constrain_cache(MagicPigCache(
        k=tuple(k), v=tuple(v), lengths_B=n_B, exact_pos_BX=exact_pos_BX,
        gen_count=jnp.int32(0), mu=tuple(mu), w=tuple(w), pool_len_B=out_len_B,
        handle=handle, cand_total=jnp.float32(0), pool_total=jnp.float32(0)))

  def _evict(self, cache: MagicPigCache) -> MagicPigCache:
    """Hashes the oldest half of the generated buffer into the pool and shifts the rest down."""
    a = self.cfg.attention
    exact, E = a.sink + a.window, a.generated_buffer // 2
    B = cache.lengths_B.shape[0]
    keep = a.generated_buffer - E
    k, v = list(cache.k), list(cache.v)
    out_len_B = cache.pool_len_B
    for layer, idx in self.store_index.items():
      old_k = k[layer][:, :, exact:exact + E]
      old_v = v[layer][:, :, exact:exact + E]
      codes = self._append_codes(old_k, cache.mu[layer], cache.w[layer])
      out_len_B = jnp.maximum(out_len_B, self.sharding.store_insert(
          cache.handle, idx, old_k, old_v, codes, jnp.full((B,), E, jnp.int32), cache.mu[layer]))
      k[layer] = _shift_generated(k[layer], exact, E, keep)
      v[layer] = _shift_generated(v[layer], exact, E, keep)
    pos = cache.exact_pos_BX
    pos = jnp.concatenate([pos[:, :exact], pos[:, exact + E:], jnp.full((B, E), -1, jnp.int32)], 1)
    return self.sharding.constrain_cache(dataclasses.replace(
        cache, k=tuple(k), v=tuple(v), exact_pos_BX=pos, gen_count=cache.gen_count - E,
        pool_len_B=out_len_B))


def _shift_generated(x_BKXD, exact: int, evicted: int, keep: int):
  tail = jnp.zeros_like(x_BKXD[:, :, :evicted])
  return jnp.concatenate([x_BKXD[:, :, :exact], x_BKXD[:, :, exact + evicted:exact + evicted + keep],
                          tail], axis=2)


def _write_at(cache_BKXD, new_BTKD, index):
  """Writes one token's keys/values at the same exact-buffer index for every slot."""
  return jax.lax.dynamic_update_slice(cache_BKXD, jnp.swapaxes(new_BTKD, 1, 2).astype(
      cache_BKXD.dtype), (0, 0, index, 0))
