"""Dense attention over a per-slot KV cache, and the cache pytree the decode step donates.

A batch row ("slot") holds one sequence; `lengths_B` counts the tokens already in its cache, so
prompts of different lengths share one batch (right padding: a padded token is written past the
slot's length, never becomes visible, and is overwritten by the next real token).

Shape key:
  B batch   T tokens in this call   S cache positions   H query heads   K kv heads
  G query heads per kv head (H = K * G)   D head dim
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DenseCache:
  k: tuple[jax.Array, ...]  # per layer [B, K, S, D]
  v: tuple[jax.Array, ...]  # per layer [B, K, S, D]
  lengths_B: jax.Array  # int32 tokens in the cache per slot

  @classmethod
  def create(cls, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
             dtype) -> DenseCache:
    shape = (batch, num_kv_heads, max_len, head_dim)
    return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
               v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
               lengths_B=jnp.zeros((batch,), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.k[0].shape[2]


def write_kv(cache_BKSD: jax.Array, new_BTKD: jax.Array, start_B: jax.Array) -> jax.Array:
  """Writes new_BTKD into each slot's cache at its own start position.

  A scatter (not a vmapped dynamic_update_slice) so that XLA updates the donated cache in place
  instead of copying it every step; positions past the cache end (prefill padding) are dropped.
  """
  B, T = new_BTKD.shape[:2]
  b_B11 = jnp.arange(B)[:, None, None]
  k_11K = jnp.arange(new_BTKD.shape[2])[None, None, :]
  s_BT1 = (start_B[:, None] + jnp.arange(T)[None, :])[:, :, None]
  return cache_BKSD.at[b_B11, k_11K, s_BT1].set(new_BTKD.astype(cache_BKSD.dtype), mode="drop")


def attend_with_lse(q_BTHD: jax.Array, k_BKSD: jax.Array, v_BKSD: jax.Array,
                    visible_BTS: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Softmax attention of each query over its visible keys (GQA).

  Returns:
    out_BTHD (float32; zero where nothing is visible) and lse_BTH (float32 log-sum-exp of the
    scaled scores; -inf where nothing is visible), so partial attentions can be merged.
  """
  B, T, H, D = q_BTHD.shape
  K = k_BKSD.shape[1]
  q_BTKGD = q_BTHD.reshape(B, T, K, H // K, D)
  s_BKGTS = jnp.einsum("btkgd,bksd->bkgts", q_BTKGD, k_BKSD,
                       preferred_element_type=jnp.float32) * (D**-0.5)
  s_BKGTS = jnp.where(visible_BTS[:, None, None], s_BKGTS, -jnp.inf)
  m_BKGT = jnp.max(s_BKGTS, axis=-1)
  m_safe = jnp.where(jnp.isfinite(m_BKGT), m_BKGT, 0.0)
  p_BKGTS = jnp.exp(s_BKGTS - m_safe[..., None])
  z_BKGT = jnp.sum(p_BKGTS, axis=-1)
  out_BKGTD = jnp.einsum("bkgts,bksd->bkgtd", p_BKGTS.astype(v_BKSD.dtype), v_BKSD,
                         preferred_element_type=jnp.float32)
  out_BKGTD = out_BKGTD / jnp.where(z_BKGT > 0, z_BKGT, 1.0)[..., None]
  lse_BKGT = jnp.where(z_BKGT > 0, m_safe + jnp.log(jnp.where(z_BKGT > 0, z_BKGT, 1.0)), -jnp.inf)
  out_BTHD = jnp.transpose(out_BKGTD, (0, 3, 1, 2, 4)).reshape(B, T, H, D)
  lse_BTH = jnp.transpose(lse_BKGT, (0, 3, 1, 2)).reshape(B, T, H)
  return out_BTHD, lse_BTH


def causal_visibility(positions_BT: jax.Array, num_keys: int) -> jax.Array:
  """visible[b, t, s] = key position s is at or before query position positions[b, t]."""
  return jnp.arange(num_keys)[None, None, :] <= positions_BT[:, :, None]


def dense_attend(layer: int, q_BTHD, k_BTKD, v_BTKD, cache: DenseCache):
  """The dense backend: write this call's keys/values, attend causally over the slot's cache."""
  k = write_kv(cache.k[layer], k_BTKD, cache.lengths_B)
  v = write_kv(cache.v[layer], v_BTKD, cache.lengths_B)
  T = q_BTHD.shape[1]
  positions_BT = cache.lengths_B[:, None] + jnp.arange(T)[None, :]
  out_BTHD, _ = attend_with_lse(q_BTHD, k, v, causal_visibility(positions_BT, k.shape[2]))
  cache = dataclasses.replace(cache, k=replace_at(cache.k, layer, k), v=replace_at(cache.v, layer, v))
  return out_BTHD, cache


def replace_at(xs: tuple, i: int, x) -> tuple:
  """A copy of tuple xs with item i replaced (per-layer cache entries)."""
  return xs[:i] + (x,) + xs[i + 1:]
