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

The pool estimator is a strategy (`pigjax.estimators`, chosen by attention.estimator): it makes
the layer's fixed operand (SimHash's matrix), the mean key and codes operand of a new pool, the
codes of appended keys and of each step's queries; the host store runs the estimator's kernel and
its attend returns (o, lse, count) over the pool whatever the estimator, so the merge is the same.

Per-row state (the generated-buffer fill, the candidate counters) is [B] arrays, so the same
backend serves rows that start together (`Engine`) and rows admitted one at a time at different
steps (continuous batching: `init_running`, `insert_row`, `free_row`, `maintain`).

Shape key:
  B batch   T tokens in this call   S dense cache positions   X exact-buffer entries
  H query heads   K kv heads   D head dim   L hash tables   P pool tokens of this call
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pigjax import attention, estimators, host_attention, placement
from pigjax.config import Config, validate_attention
from pigjax.sharding import Sharding, mesh_requested
from pigjax.step import Programs
from pigjax.store import HostKVStore, store_insert


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MagicPigCache:
  k: tuple  # per layer: dense [B, K, S, D]; sparse: exact buffer [B, K, X, D]
  v: tuple
  lengths_B: jax.Array  # int32 tokens seen per slot (prompt + generated)
  exact_pos_BX: jax.Array  # int32 position of each exact-buffer entry, -1 if empty
  gen_count_B: jax.Array  # int32 generated tokens currently in each row's exact buffer
  mu: tuple  # per layer: sparse [B, K, D] pool mean key; dense None
  w: tuple  # per layer: the estimator's fixed operand (SimHash matrix) or None
  pool_len_B: jax.Array  # int32 pool tokens per slot (FFI insert's output: orders attends)
  handle: jax.Array  # int32 scalar: the host store
  cand_total_B: jax.Array  # f32: candidates attended, summed over steps, sparse layers, heads
  pool_total_B: jax.Array  # f32: pool tokens available, summed likewise


class MagicPigBackend:
  """Attention backend for `pigjax.engine.Engine` with a host-resident, LSH-indexed pool."""

  def __init__(self, cfg: Config):
    a, m = cfg.attention, cfg.model
    validate_attention(a, m.num_layers)
    self.estimator = estimators.create(a, m.head_dim)
    placement.place_for("magicpig")  # the host store's FFI calls are CPU-only
    self.cfg = cfg
    self.host_decode = host_attention.use_host_kernel(cfg)  # dense layers' decode attention
    self.sparse_layers = [l for l in range(m.num_layers) if l not in set(a.dense_layers)]
    self.store_index = {l: i for i, l in enumerate(self.sparse_layers)}
    if not self.estimator.runs_on_mesh and mesh_requested(cfg.mesh):
      raise ValueError(f"attention.estimator={a.estimator!r} runs on one device (its store is not "
                       "tested under shard_map yet); on a mesh use estimator='magicpig' or "
                       "attention.kind='dense'.")
    self.sharding = Sharding.create(cfg.mesh, m)
    # Host stores by (data, model) mesh coordinate: one, at (0, 0), without a mesh.
    self.stores: dict[tuple[int, int], HostKVStore] = {}
    self.programs = Programs()  # the store-maintenance programs (after_prefill, after_step)

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
    """The decode cache from a dense prefill (donated): exact buffer on the device, the pool in
    the store. Blocks until the inserts are done."""
    handle = self._handle()
    with warnings.catch_warnings():
      # Donation lets dense layers keep their caches in place; the sparse layers' full caches are
      # freed rather than reused, which jax reports as "not usable".
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      # Block: host-side store calls (num_tokens, reset) are not ordered after dispatched work.
      return jax.block_until_ready(
          self.programs.run("prefill", self.split_prefill, cache, handle, donate=(0,)))

  def after_step(self, cache: MagicPigCache) -> MagicPigCache:
    """Between decode steps: rows whose generated buffer is full move its older half into the
    pool (every row of an `Engine` batch fills at the same step)."""
    if not self.needs_maintenance(cache):
      return cache
    active_B = jnp.ones(cache.lengths_B.shape, bool)
    return self.programs.run("maintain", self.maintain, cache, active_B, donate=(0,))

  def stats(self, cache) -> dict:
    """pool_fraction: pool rows read (magicpig: candidates; proxy: the exact top rows) over pool
    rows available, and whatever the estimator reports (the proxy: index_bytes_per_token, the
    index it scans per pool token and KV head every step, next to the rows it reads)."""
    extra = self.estimator.stats()
    if not isinstance(cache, MagicPigCache):
      return {"pool_fraction": 0.0, **extra}
    pool = float(jnp.sum(cache.pool_total_B))
    return {"pool_fraction": float(jnp.sum(cache.cand_total_B)) / pool if pool else 0.0, **extra}

  def row_stats(self, cache: MagicPigCache) -> dict[str, jax.Array]:
    return {"cand_total_B": cache.cand_total_B, "pool_total_B": cache.pool_total_B}

  # -- attention ----------------------------------------------------------------------------

  prefill_attend = staticmethod(attention.dense_attend)

  def decode_attend(self, layer: int, q_BTHD, k_BTKD, v_BTKD, cache: MagicPigCache):
    if layer not in self.store_index:
      return attention.dense_attend(layer, q_BTHD, k_BTKD, v_BTKD, cache,
                                    host=self.host_decode)
    a = self.cfg.attention
    B, _, H, _ = q_BTHD.shape
    x_new_B = a.sink + a.window + cache.gen_count_B
    # The barrier materialises each written buffer once: without it XLA:CPU duplicates the
    # update into both of its users (the attention below and the returned cache), and each
    # duplicate copies the whole buffer first (8 copies of [B, K, X, D] per layer and step).
    k, v = jax.lax.optimization_barrier((_write_rows(cache.k[layer], k_BTKD, x_new_B),
                                         _write_rows(cache.v[layer], v_BTKD, x_new_B)))
    exact_pos_BX = cache.exact_pos_BX.at[jnp.arange(B), x_new_B].set(cache.lengths_B,
                                                                      mode="drop")
    o_BHD, count_BH = self._exact_and_pool(layer, q_BTHD, k, v, exact_pos_BX, cache)
    cache = dataclasses.replace(
        cache, k=attention.replace_at(cache.k, layer, k), v=attention.replace_at(cache.v, layer, v),
        exact_pos_BX=exact_pos_BX,
        cand_total_B=cache.cand_total_B + jnp.sum(count_BH, axis=1, dtype=jnp.float32),
        pool_total_B=cache.pool_total_B + H * cache.pool_len_B.astype(jnp.float32))
    # The buffer fill advances once per step, after the last sparse layer.
    if layer == self.sparse_layers[-1]:
      cache = dataclasses.replace(cache, gen_count_B=cache.gen_count_B + 1)
    return o_BHD[:, None].astype(q_BTHD.dtype), cache

  def _exact_and_pool(self, layer: int, q_BTHD, k_BKXD, v_BKXD, exact_pos_BX, cache):
    """Exact attention over the buffer (sink, window, generated) merged with the store's
    estimate over the pool; returns o [B, H, D] and the candidates counted per row and head."""
    q_BHD = q_BTHD[:, 0]
    if self.host_decode:  # the host kernel: XLA ran this small masked attention as ~10 ops
      o_ex_BHD, lse_ex_BH = host_attention.decode_attend_masked(q_BHD, k_BKXD, v_BKXD,
                                                                exact_pos_BX >= 0)
    else:
      o_ex_BTHD, lse_ex_BTH = attention.attend_with_lse(q_BTHD, k_BKXD, v_BKXD,
                                                        (exact_pos_BX >= 0)[:, None])
      o_ex_BHD, lse_ex_BH = o_ex_BTHD[:, 0], lse_ex_BTH[:, 0]
    qcodes_BHL = self.estimator.query_codes(q_BHD, cache.w[layer])
    o_pool_BHD, lse_pool_BH, count_BH = self.sharding.store_attend(
        cache.handle, self.store_index[layer], q_BHD, qcodes_BHL, cache.pool_len_B)
    o_BHD, _ = attention.merge_attention(o_ex_BHD, lse_ex_BH, o_pool_BHD, lse_pool_BH)
    return o_BHD, count_BH

  # -- continuous batching: rows one at a time ----------------------------------------------

  def init_running(self, batch: int, max_len: int, dtype) -> MagicPigCache:
    """An empty running cache of `batch` rows; (re)creates the host store with that many slots."""
    dense = self.create_cache(batch, max_len, dtype)  # sizes the store; its rows are empty
    a, m = self.cfg.attention, self.cfg.model
    X = a.sink + a.window + a.generated_buffer
    exact = lambda: jnp.zeros((batch, m.num_kv_heads, X, m.head_dim), dtype)
    sparse = [l in self.store_index for l in range(m.num_layers)]
    rows = lambda dtype: jnp.zeros((batch,), dtype)
    return MagicPigCache(
        k=tuple(exact() if s else k for s, k in zip(sparse, dense.k)),
        v=tuple(exact() if s else v for s, v in zip(sparse, dense.v)),
        lengths_B=rows(jnp.int32), exact_pos_BX=jnp.full((batch, X), -1, jnp.int32),
        gen_count_B=rows(jnp.int32),
        mu=tuple(jnp.zeros((batch, m.num_kv_heads, m.head_dim), jnp.float32) if s else None
                 for s in sparse),
        w=tuple(self.estimator.layer_matrix(l) if s else None for l, s in enumerate(sparse)),
        pool_len_B=rows(jnp.int32), handle=self._handle(),
        cand_total_B=rows(jnp.float32), pool_total_B=rows(jnp.float32))

  def free_row(self, slot: int) -> None:
    """Empties the row's host-store slot, so an idle row attends an empty pool. The caller must
    have waited for every dispatched step (host calls are not ordered after them)."""
    if self.store is not None:
      self.store.reset(slot)

  def insert_row(self, running: MagicPigCache, single: attention.DenseCache,
                 slot) -> MagicPigCache:
    """Jit-friendly: splits the batch-1 dense prefill into exact buffer + pool, inserts the pool
    into store slot `slot` (reset beforehand by `free_row`) and writes row `slot`."""
    one = self.split_prefill(single, running.handle, slots_B=jnp.reshape(slot, (1,)))
    put, puts = attention.put_row, attention.put_rows
    return dataclasses.replace(
        running, k=puts(running.k, one.k, slot), v=puts(running.v, one.v, slot),
        lengths_B=put(running.lengths_B, one.lengths_B, slot),
        exact_pos_BX=put(running.exact_pos_BX, one.exact_pos_BX, slot),
        gen_count_B=put(running.gen_count_B, one.gen_count_B, slot),
        mu=puts(running.mu, one.mu, slot),
        pool_len_B=put(running.pool_len_B, one.pool_len_B, slot),
        cand_total_B=put(running.cand_total_B, one.cand_total_B, slot),
        pool_total_B=put(running.pool_total_B, one.pool_total_B, slot))

  def needs_maintenance(self, cache: MagicPigCache) -> bool:
    """Whether some row's generated buffer is full (checked on the host between steps)."""
    return int(np.max(np.asarray(cache.gen_count_B))) >= self.cfg.attention.generated_buffer

  # -- jitted host-store maintenance --------------------------------------------------------

  def split_prefill(self, dense: attention.DenseCache, handle, slots_B=None) -> MagicPigCache:
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
      w_l = self.estimator.layer_matrix(layer)
      kp_BKPD = jnp.take(k_BKSD, jnp.minimum(pool_idx_P, S - 1), axis=2)
      vp_BKPD = jnp.take(v_BKSD, jnp.minimum(pool_idx_P, S - 1), axis=2)
      valid_BKP = jnp.broadcast_to(pool_valid_BP[:, None], kp_BKPD.shape[:3])
      mu_BKD, codes_BKPL = self.estimator.index(kp_BKPD, valid_BKP, w_l)
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
        gen_count_B=jnp.zeros((B,), jnp.int32), mu=tuple(mu), w=tuple(w), pool_len_B=out_len_B,
        handle=handle, cand_total_B=jnp.zeros((B,), jnp.float32),
        pool_total_B=jnp.zeros((B,), jnp.float32)))

  def maintain(self, cache: MagicPigCache, active_B) -> MagicPigCache:
    """Jit-friendly: every row whose generated buffer is full shifts out its older half; active
    rows hash it into their pools (the estimator's append codes, centred on the pool's mean),
    idle rows drop it."""
    a = self.cfg.attention
    exact, E = a.sink + a.window, a.generated_buffer // 2
    B = cache.lengths_B.shape[0]
    keep = a.generated_buffer - E
    full_B = cache.gen_count_B >= a.generated_buffer
    insert_B = jnp.where(full_B & active_B, E, 0).astype(jnp.int32)
    full_B111 = full_B[:, None, None, None]
    k, v = list(cache.k), list(cache.v)
    out_len_B = cache.pool_len_B
    for layer, idx in self.store_index.items():
      old_k, old_v = k[layer][:, :, exact:exact + E], v[layer][:, :, exact:exact + E]
      codes = self.estimator.append_codes(old_k, cache.mu[layer], cache.w[layer])
      out_len_B = jnp.maximum(out_len_B, self.sharding.store_insert(
          cache.handle, idx, old_k, old_v, codes, insert_B, cache.mu[layer]))
      k[layer] = jnp.where(full_B111, _shift_generated(k[layer], exact, E, keep), k[layer])
      v[layer] = jnp.where(full_B111, _shift_generated(v[layer], exact, E, keep), v[layer])
    pos = cache.exact_pos_BX
    shifted = jnp.concatenate([pos[:, :exact], pos[:, exact + E:],
                               jnp.full((B, E), -1, jnp.int32)], 1)
    return self.sharding.constrain_cache(dataclasses.replace(
        cache, k=tuple(k), v=tuple(v), exact_pos_BX=jnp.where(full_B[:, None], shifted, pos),
        gen_count_B=jnp.where(full_B, cache.gen_count_B - E, cache.gen_count_B),
        pool_len_B=out_len_B))


def _shift_generated(x_BKXD, exact: int, evicted: int, keep: int):
  tail = jnp.zeros_like(x_BKXD[:, :, :evicted])
  return jnp.concatenate([x_BKXD[:, :, :exact], x_BKXD[:, :, exact + evicted:exact + evicted + keep],
                          tail], axis=2)


def _write_rows(cache_BKXD, new_BTKD, index_B):
  """Writes one token's keys/values at each row's own exact-buffer index (T == 1)."""
  B, _, K, _ = new_BTKD.shape
  b_B1 = jnp.arange(B)[:, None]
  k_1K = jnp.arange(K)[None, :]
  return cache_BKXD.at[b_B1, k_1K, index_B[:, None]].set(
      new_BTKD[:, 0].astype(cache_BKXD.dtype), mode="drop")
