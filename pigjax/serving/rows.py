"""Per-row cache operations for continuous batching: put one prefilled request into one row of the
running cache, and keep MagicPIG's generated-token buffers per row.

A request is prefilled alone (batch 1, dense, in chunks) into its own cache; `insert_row` then
copies it into row `slot` of the running batch's cache without touching the other rows. For
MagicPIG the insert also hashes the request's pool into its host-store slot (docs/serving.md).

`MagicPigBackend` keeps one generated-buffer count for the whole batch, because `Engine.generate`
starts every row together. Rows of a continuous batch join at different steps, so
`RowMagicPigBackend` keeps `gen_count`, `cand_total` and `pool_total` as [B] arrays and evicts
each row's buffer on its own schedule.

Shape key:
  B batch rows   K kv heads   S dense cache positions   X exact-buffer entries   D head dim
  H query heads   T tokens in this call
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pigjax import attention
from pigjax.engine import DenseBackend
from pigjax.magicpig import MagicPigBackend, MagicPigCache, _shift_generated
from pigjax.store import store_insert


def _put_row(x_B, y_1, slot):
  """x_B with row `slot` replaced by y_1's only row (y_1 has a leading batch axis of 1)."""
  return jax.lax.dynamic_update_index_in_dim(x_B, y_1[0].astype(x_B.dtype), slot, 0)


def _put_rows(xs: tuple, ys: tuple, slot) -> tuple:
  return tuple(x if x is None else _put_row(x, y, slot) for x, y in zip(xs, ys))


class RowDenseBackend(DenseBackend):
  """The dense backend with the two per-row operations the scheduler needs."""

  def init_running(self, batch: int, max_len: int, dtype) -> attention.DenseCache:
    return self.create_cache(batch, max_len, dtype)

  def insert_row(self, running: attention.DenseCache, single: attention.DenseCache,
                 slot) -> attention.DenseCache:
    """Jit-friendly: row `slot` of `running` becomes the batch-1 prefilled `single`."""
    return attention.DenseCache(k=_put_rows(running.k, single.k, slot),
                                v=_put_rows(running.v, single.v, slot),
                                lengths_B=_put_row(running.lengths_B, single.lengths_B, slot))

  def free_row(self, slot: int) -> None:
    """Nothing to release: the row's stale entries are overwritten by the next insert."""

  def needs_maintenance(self, cache) -> bool:
    return False

  def maintain(self, cache, active_B):
    return cache

  def row_stats(self, cache) -> dict[str, jax.Array]:
    return {}


class RowMagicPigBackend(MagicPigBackend):
  """MagicPIG with per-row generated buffers (rows admitted at different decode steps)."""

  def init_running(self, batch: int, max_len: int, dtype) -> MagicPigCache:
    """An empty running cache of `batch` rows; (re)creates the host store with that many slots."""
    dense = self.create_cache(batch, max_len, dtype)  # sizes the store; its rows are empty
    a, m = self.cfg.attention, self.cfg.model
    X = a.sink + a.window + a.generated_buffer
    exact = lambda: jnp.zeros((batch, m.num_kv_heads, X, m.head_dim), dtype)
    sparse = [l in self.store_index for l in range(m.num_layers)]
    return MagicPigCache(
        k=tuple(exact() if s else k for s, k in zip(sparse, dense.k)),
        v=tuple(exact() if s else v for s, v in zip(sparse, dense.v)),
        lengths_B=jnp.zeros((batch,), jnp.int32),
        exact_pos_BX=jnp.full((batch, X), -1, jnp.int32),
        gen_count=jnp.zeros((batch,), jnp.int32),
        mu=tuple(jnp.zeros((batch, m.num_kv_heads, m.head_dim), jnp.float32) if s else None
                 for s in sparse),
        w=tuple(self._hash_matrix(l) if s else None for l, s in enumerate(sparse)),
        pool_len_B=jnp.zeros((batch,), jnp.int32),
        handle=jnp.int32(self.store.handle if self.store is not None else -1),
        cand_total=jnp.zeros((batch,), jnp.float32), pool_total=jnp.zeros((batch,), jnp.float32))

  def free_row(self, slot: int) -> None:
    """Empties the row's host-store slot, so an idle row attends an empty pool. The caller must
    have waited for every dispatched step (host calls are not ordered after them)."""
    if self.store is not None:
      self.store.reset(slot)

  def insert_row(self, running: MagicPigCache, single: attention.DenseCache,
                 slot) -> MagicPigCache:
    """Jit-friendly: splits the batch-1 dense prefill into exact buffer + pool, inserts the pool
    into store slot `slot` (reset beforehand by `free_row`) and writes row `slot`."""
    one = self._split_prefill(single, running.handle, slots_B=jnp.reshape(slot, (1,)))
    return dataclasses.replace(
        running, k=_put_rows(running.k, one.k, slot), v=_put_rows(running.v, one.v, slot),
        lengths_B=_put_row(running.lengths_B, one.lengths_B, slot),
        exact_pos_BX=_put_row(running.exact_pos_BX, one.exact_pos_BX, slot),
        gen_count=running.gen_count.at[slot].set(0),
        mu=_put_rows(running.mu, one.mu, slot),
        pool_len_B=_put_row(running.pool_len_B, one.pool_len_B, slot),
        cand_total=running.cand_total.at[slot].set(0),
        pool_total=running.pool_total.at[slot].set(0))

  def row_stats(self, cache: MagicPigCache) -> dict[str, jax.Array]:
    return {"cand_total_B": cache.cand_total, "pool_total_B": cache.pool_total}

  # -- decode ---------------------------------------------------------------------------------

  def decode_attend(self, layer: int, q_BTHD, k_BTKD, v_BTKD, cache: MagicPigCache):
    """`MagicPigBackend.decode_attend` with each row writing at its own buffer index."""
    if layer not in self.store_index:
      return attention.dense_attend(layer, q_BTHD, k_BTKD, v_BTKD, cache,
                                    host=self.host_decode)
    a = self.cfg.attention
    B, _, H, _ = q_BTHD.shape
    x_new_B = a.sink + a.window + cache.gen_count
    # Materialised once (see MagicPigBackend.decode_attend: XLA would copy each buffer per user).
    k, v = jax.lax.optimization_barrier((_write_rows(cache.k[layer], k_BTKD, x_new_B),
                                         _write_rows(cache.v[layer], v_BTKD, x_new_B)))
    exact_pos_BX = cache.exact_pos_BX.at[jnp.arange(B), x_new_B].set(cache.lengths_B,
                                                                      mode="drop")
    o_BHD, count_BH = self._exact_and_pool(layer, q_BTHD, k, v, exact_pos_BX, cache)
    cache = dataclasses.replace(
        cache, k=attention.replace_at(cache.k, layer, k), v=attention.replace_at(cache.v, layer, v),
        exact_pos_BX=exact_pos_BX,
        cand_total=cache.cand_total + jnp.sum(count_BH, axis=1, dtype=jnp.float32),
        pool_total=cache.pool_total + H * cache.pool_len_B.astype(jnp.float32))
    if layer == self.sparse_layers[-1]:
      cache = dataclasses.replace(cache, gen_count=cache.gen_count + 1)
    return o_BHD[:, None].astype(q_BTHD.dtype), cache

  def needs_maintenance(self, cache: MagicPigCache) -> bool:
    """Whether some row's generated buffer is full (checked on the host between steps)."""
    return bool(jnp.max(cache.gen_count) >= self.cfg.attention.generated_buffer)

  def maintain(self, cache: MagicPigCache, active_B) -> MagicPigCache:
    """Jit-friendly per-row `_evict`: every row whose buffer is full shifts out its older half;
    active rows hash it into their pools, idle rows drop it."""
    a = self.cfg.attention
    exact, E = a.sink + a.window, a.generated_buffer // 2
    B = cache.lengths_B.shape[0]
    keep = a.generated_buffer - E
    full_B = cache.gen_count >= a.generated_buffer
    insert_B = jnp.where(full_B & active_B, E, 0).astype(jnp.int32)
    k, v = list(cache.k), list(cache.v)
    out_len_B = cache.pool_len_B
    for layer, idx in self.store_index.items():
      old_k, old_v = k[layer][:, :, exact:exact + E], v[layer][:, :, exact:exact + E]
      codes = self._append_codes(old_k, cache.mu[layer], cache.w[layer])
      out_len_B = jnp.maximum(out_len_B, store_insert(
          cache.handle, idx, jnp.arange(B, dtype=jnp.int32), old_k, old_v, codes, insert_B,
          cache.mu[layer]))
      full_B111 = full_B[:, None, None, None]
      k[layer] = jnp.where(full_B111, _shift_generated(k[layer], exact, E, keep), k[layer])
      v[layer] = jnp.where(full_B111, _shift_generated(v[layer], exact, E, keep), v[layer])
    pos = cache.exact_pos_BX
    shifted = jnp.concatenate([pos[:, :exact], pos[:, exact + E:],
                               jnp.full((B, E), -1, jnp.int32)], 1)
    return dataclasses.replace(cache, k=tuple(k), v=tuple(v),
                               exact_pos_BX=jnp.where(full_B[:, None], shifted, pos),
                               gen_count=jnp.where(full_B, cache.gen_count - E, cache.gen_count),
                               pool_len_B=out_len_B)


def _write_rows(cache_BKXD, new_BTKD, index_B):
  """Writes one token's keys/values at each row's own exact-buffer index (T == 1)."""
  B, _, K, _ = new_BTKD.shape
  b_B1 = jnp.arange(B)[:, None]
  k_1K = jnp.arange(K)[None, :]
  return cache_BKXD.at[b_B1, k_1K, index_B[:, None]].set(
      new_BTKD[:, 0].astype(cache_BKXD.dtype), mode="drop")


def make_row_backend(cfg):
  """The per-row backend for `cfg.attention.kind`."""
  if cfg.attention.kind == "dense":
    return RowDenseBackend(cfg)
  if cfg.attention.kind == "magicpig":
    return RowMagicPigBackend(cfg)
  raise ValueError(f"Unknown attention.kind {cfg.attention.kind!r}; use 'dense' or 'magicpig'.")
