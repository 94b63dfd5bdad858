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
import functools

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


# Keys per block of the blocked attention. 512 keys x 512 queries x G heads of float32 scores is
# a few MB per kv head: large enough that the matmuls stay efficient and the while loop's
# per-block overhead is small, small enough that the work tracks the filled prefix closely.
KEY_BLOCK = 512


def key_block(num_keys: int, want: int | None = None) -> int:
  """The block size for a cache of num_keys positions: `want` (default KEY_BLOCK) if it divides
  the cache, else the largest divisor of num_keys in [want / 8, want], else the whole cache as one
  block."""
  want = want or KEY_BLOCK
  if num_keys <= want:
    return num_keys
  for b in range(want, max(want // 8, 1) - 1, -1):
    if num_keys % b == 0:
      return b
  return num_keys


def _block_scores(q_BKGTD: jax.Array, k_BKsD: jax.Array) -> jax.Array:
  """float32 q . k for a key block: [B, K, G, T, s].

  For one query per row (decode) the keys are the dot's left operand, contracted on their minor
  axis, so XLA:CPU reads them in place; written as q @ k^T it first copies every key of the cache
  into [d, s] order, a second pass over K per step that makes this dot up to 4x slower at 8k.
  Prefill chunks (T > 1) keep the q @ k^T form, a compute-bound GEMM.
  """
  B, K, G, T, D = q_BKGTD.shape
  if T > 1:
    return jnp.einsum("bkgtd,bksd->bkgts", q_BKGTD, k_BKsD, preferred_element_type=jnp.float32)
  s_BKsG = jax.lax.dot_general(k_BKsD, q_BKGTD[:, :, :, 0], (((3,), (3,)), ((0, 1), (0, 1))),
                               preferred_element_type=jnp.float32)
  return jnp.swapaxes(s_BKsG, 2, 3)[:, :, :, None]


def causal_attend_blocked(q_BTHD: jax.Array, k_BKSD: jax.Array, v_BKSD: jax.Array,
                          positions_BT: jax.Array, block: int | None = None) -> jax.Array:
  """Causal attention over the filled prefix only, one key block at a time (online softmax).

  Query t of row b sees key positions <= positions_BT[b, t]. The loop runs over key blocks up to
  the last one any query of this call can see, so a chunk's cost grows with the prefix that is
  filled, not with the cache size, and blocks wholly in every query's future are never read
  (FlashAttention's schedule; its running max and sum keep the result exact).

  Returns:
    out_BTHD (float32; zero for a query that sees nothing, which only a negative position can do).
  """
  B, T, H, D = q_BTHD.shape
  K, S = k_BKSD.shape[1], k_BKSD.shape[2]
  G = H // K
  block = key_block(S) if block is None else block
  if S % block:
    raise ValueError(f"key block {block} must divide the cache length {S}.")
  # Scale once here rather than every score; (b, k) lead so each block is one batched matmul.
  q_BKGTD = jnp.transpose(q_BTHD.reshape(B, T, K, G, D), (0, 2, 3, 1, 4)) * jnp.asarray(
      D**-0.5, q_BTHD.dtype)
  last_visible = jnp.clip(jnp.max(positions_BT), 0, S - 1)
  num_blocks = last_visible // block + 1

  def body(i, carry):
    m_BKGT, l_BKGT, acc_BKGTD = carry
    start = i * block
    k_BKsD = jax.lax.dynamic_slice_in_dim(k_BKSD, start, block, axis=2)
    v_BKsD = jax.lax.dynamic_slice_in_dim(v_BKSD, start, block, axis=2)
    s_BKGTs = _block_scores(q_BKGTD, k_BKsD)
    visible_BTs = (start + jnp.arange(block))[None, None, :] <= positions_BT[:, :, None]
    s_BKGTs = jnp.where(visible_BTs[:, None, None], s_BKGTs, -jnp.inf)
    m_new = jnp.maximum(m_BKGT, jnp.max(s_BKGTs, axis=-1))
    # A query that has seen nothing yet keeps m = -inf; shift by 0 so exp gives 0, not NaN.
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p_BKGTs = jnp.exp(s_BKGTs - m_safe[..., None])
    rescale = jnp.exp(m_BKGT - m_safe)
    l_BKGT = l_BKGT * rescale + jnp.sum(p_BKGTs, axis=-1)
    acc_BKGTD = acc_BKGTD * rescale[..., None] + jnp.einsum(
        "bkgts,bksd->bkgtd", p_BKGTs.astype(v_BKSD.dtype), v_BKsD,
        preferred_element_type=jnp.float32)
    return m_new, l_BKGT, acc_BKGTD

  init = (jnp.full((B, K, G, T), -jnp.inf, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
          jnp.zeros((B, K, G, T, D), jnp.float32))
  _, l_BKGT, acc_BKGTD = jax.lax.fori_loop(0, num_blocks, body, init)
  out_BKGTD = acc_BKGTD / jnp.where(l_BKGT > 0, l_BKGT, 1.0)[..., None]
  return jnp.transpose(out_BKGTD, (0, 3, 1, 2, 4)).reshape(B, T, H, D)


def dense_attend(layer: int, q_BTHD, k_BTKD, v_BTKD, cache: DenseCache, host: bool = False):
  """The dense backend: write this call's keys/values, attend causally over the slot's filled
  prefix (blocked: the padded tail of the cache is never read).

  With `host`, a decode call (one token per row) attends in the C++ kernel of
  `pigjax.host_attention` (CPU only); prefill chunks always take the jnp path.
  """
  k = write_kv(cache.k[layer], k_BTKD, cache.lengths_B)
  v = write_kv(cache.v[layer], v_BTKD, cache.lengths_B)
  T = q_BTHD.shape[1]
  if host and T == 1:
    from pigjax import host_attention  # the extension: only where the host kernel is asked for
    o_BHD, _ = host_attention.decode_attend(q_BTHD[:, 0], k, v, cache.lengths_B + 1)
    out_BTHD = o_BHD[:, None].astype(q_BTHD.dtype)
  else:
    positions_BT = cache.lengths_B[:, None] + jnp.arange(T)[None, :]
    out_BTHD = causal_attend_blocked(q_BTHD, k, v, positions_BT)
  cache = dataclasses.replace(cache, k=replace_at(cache.k, layer, k), v=replace_at(cache.v, layer, v))
  return out_BTHD, cache


def dense_attend_full(layer: int, q_BTHD, k_BTKD, v_BTKD, cache: DenseCache):
  """dense_attend over the whole padded cache in one masked softmax: the unblocked form, the
  reference the blocked path is tested against."""
  k = write_kv(cache.k[layer], k_BTKD, cache.lengths_B)
  v = write_kv(cache.v[layer], v_BTKD, cache.lengths_B)
  T = q_BTHD.shape[1]
  positions_BT = cache.lengths_B[:, None] + jnp.arange(T)[None, :]
  out_BTHD, _ = attend_with_lse(q_BTHD, k, v, causal_visibility(positions_BT, k.shape[2]))
  cache = dataclasses.replace(cache, k=replace_at(cache.k, layer, k), v=replace_at(cache.v, layer, v))
  return out_BTHD, cache


def merge_attention(o1_BHD: jax.Array, lse1_BH: jax.Array, o2_BHD: jax.Array,
                    lse2_BH: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Log-sum-exp merge of two partial attentions (docs/design.md, "The algorithm", step 10).

  lse = logaddexp(lse1, lse2); o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2. A part with
  lse = -inf gets weight exactly 0 (so merging with an empty part returns the other part
  exactly); both empty -> o = 0, lse = -inf.
  """
  lse_BH = jnp.logaddexp(lse1_BH, lse2_BH)
  safe_BH = jnp.where(jnp.isfinite(lse_BH), lse_BH, 0.0)

  def weight(lse_part):
    live = jnp.isfinite(lse_part)
    return jnp.where(live, jnp.exp(jnp.where(live, lse_part, 0.0) - safe_BH), 0.0)[..., None]

  o_BHD = (weight(lse1_BH) * o1_BHD.astype(jnp.float32)
           + weight(lse2_BH) * o2_BHD.astype(jnp.float32))
  return o_BHD, lse_BH

def replace_at(xs: tuple, i: int, x) -> tuple:
  """A copy of tuple xs with item i replaced (per-layer cache entries)."""
  return xs[:i] + (x,) + xs[i + 1:]


def put_row(x_B, y_1, slot):
  """x_B with row `slot` replaced by y_1's only row (y_1 has a leading batch axis of 1)."""
  return jax.lax.dynamic_update_index_in_dim(x_B, y_1[0].astype(x_B.dtype), slot, 0)


def put_rows(xs: tuple, ys: tuple, slot) -> tuple:
  """Per-layer `put_row` (None entries stay None)."""
  return tuple(x if x is None else put_row(x, y, slot) for x, y in zip(xs, ys))


class DenseBackend:
  """Full attention over a device cache in every layer (the `pigjax.step.RowBackend` protocol:
  it also serves continuous batching, where a row's stale entries are simply overwritten)."""

  programs = None  # nothing compiled outside the drivers

  def __init__(self, cfg):
    from pigjax import host_attention  # the extension: loaded only by a backend that may use it
    self.cfg = cfg
    self.decode_attend = functools.partial(dense_attend, host=host_attention.use_host_kernel(cfg))

  def create_cache(self, batch: int, max_len: int, dtype) -> DenseCache:
    m = self.cfg.model
    return DenseCache.create(m.num_layers, batch, m.num_kv_heads, max_len, m.head_dim, dtype)

  prefill_attend = staticmethod(dense_attend)

  def after_prefill(self, cache, lengths_B):
    return cache

  def after_step(self, cache):
    return cache

  def stats(self, cache) -> dict:
    return {}

  # -- continuous batching ------------------------------------------------------------------

  def init_running(self, batch: int, max_len: int, dtype) -> DenseCache:
    return self.create_cache(batch, max_len, dtype)

  def insert_row(self, running: DenseCache, single: DenseCache, slot) -> DenseCache:
    """Jit-friendly: row `slot` of `running` becomes the batch-1 prefilled `single`."""
    return DenseCache(k=put_rows(running.k, single.k, slot), v=put_rows(running.v, single.v, slot),
                      lengths_B=put_row(running.lengths_B, single.lengths_B, slot))

  def free_row(self, slot: int) -> None:
    """Nothing to release: the row's stale entries are overwritten by the next insert."""

  def needs_maintenance(self, cache) -> bool:
    return False

  def maintain(self, cache, active_B):
    return cache

  def row_stats(self, cache) -> dict[str, jax.Array]:
    return {}
