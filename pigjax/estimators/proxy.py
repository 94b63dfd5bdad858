"""Pool estimators beyond the paper's: score-proxy top-k with a tail estimate.

MagicPIG samples the pool by SimHash collisions, which see only the angle between query and key;
attention weight grows with q . k = |q| |k| cos, so some heavy keys are never drawn and importance
weights cannot correct a key that was never drawn (docs/design.md, "Estimators"). The "proxy"
estimator instead scores *every* pool key cheaply and reads only the best:

1. Index (at prefill): the centred keys k~ = k - mu, quantized per channel to `proxy_bits` bits
   (uniform levels between the channel's min and max over the pool: 2 * D floats per head, and
   D * bits / 8 bytes per token, 32 at 4 bits against (10,150)'s 300 bytes of 16-bit table ids).
2. Proxy scores: s~_i = scale * (q . deq(k~_i) + q . mu) for every pool key (a scan of the index:
   its bytes are the estimator's lookup cost, reported next to the rows read). With
   deq(k~_i) = lo + code_i * step this is bias + sum_e w_e code_ie, w = scale * q * step; the
   weights are rounded to int8 on a power-of-two grid (`query_weights`), so the scan is an exact
   integer dot (the C++ kernel's int8 x 4-bit `maddubs` scan, bit for bit the same scores) and
   the ranking does not depend on summation order. The rounding moves a score by at most
   2^(x-8) * sum_e code_ie where max|w| = f 2^x: about 1% of the scores' spread, against the
   4-bit keys' 10%.
3. Selection: the k_keep keys with the largest s~ are read (K and V at full precision) and
   attended exactly: o_top, lse_top. Ties with the k_keep-th proxy score are all kept.
4. Tail (tail="mean"): the softmax mass of the keys not read is estimated from their proxy scores,
   lse_tail = logsumexp(s~ over the rest), and their value by the pool's mean V (D floats per
   head, no row read); merged with the top part by log-sum-exp. With tail="none" the rest is
   dropped, as top-k does. The tail is what top-k loses on flat heads (vAttention's observation,
   arXiv 2510.05688); here it costs no row reads.

Generated keys appended to a pool later (the host store's inserts after the first, when the
generated buffer is moved into the pool) are coded with the pool's first mu, lo and step, each
code clamped to [0, 2^bits - 1] (`quantize_with_stats`): earlier codes stay valid and an append
costs O(new keys). The C++ kernel (xla_ffi/proxy.h, store_proxy.h) does exactly this.

The probe (`scripts/probe_estimators.py`) measured the variants this module was chosen from.
This is the pure-jnp, mask-based reference (O(pool) per query, static shapes, jit-able), in the
shape conventions of `pigjax.reference`: B batch, H query heads, K kv heads, G query heads per kv
head, T pool tokens, D head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pigjax import reference
from pigjax.attention import merge_attention
from pigjax.config import PROXY_TAILS, AttentionConfig
from pigjax.estimators import register
_HIGHEST = jax.lax.Precision.HIGHEST


def quantize_stats(k_BKTD: jax.Array, valid_BKT: jax.Array,
                   bits: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The index statistics of a pool: mu_BKD (mean key; 0 for an empty pool), lo_BKD (per channel
  minimum of the centred keys) and step_BKD ((max - min) / (2^bits - 1); 1 for a constant
  channel or an empty pool, so its code is 0 and its value exact)."""
  if not 1 <= bits <= 8:
    raise ValueError(f"proxy bits must be in [1, 8], got {bits}.")
  k_BKTD = k_BKTD.astype(jnp.float32)
  m_BKT1 = valid_BKT[..., None]
  n_BK1 = jnp.sum(valid_BKT, axis=-1, dtype=jnp.float32)[..., None]
  mu_BKD = jnp.sum(jnp.where(m_BKT1, k_BKTD, 0.0), axis=2) / jnp.maximum(n_BK1, 1.0)
  kc_BKTD = k_BKTD - mu_BKD[:, :, None]
  lo_BKD = jnp.min(jnp.where(m_BKT1, kc_BKTD, jnp.inf), axis=2)
  hi_BKD = jnp.max(jnp.where(m_BKT1, kc_BKTD, -jnp.inf), axis=2)
  levels = float((1 << bits) - 1)
  ok_BKD = hi_BKD > lo_BKD
  lo_BKD = jnp.where(jnp.isfinite(lo_BKD), lo_BKD, 0.0)
  # Products with reciprocals, never divisions: XLA:CPU may rewrite a division into such a
  # product (or not), and the C++ kernel must code every key exactly as this reference does.
  step_BKD = jnp.where(ok_BKD, (hi_BKD - lo_BKD) * (1.0 / levels), 1.0)
  return mu_BKD, lo_BKD, step_BKD


def quantize_codes(k_BKTD: jax.Array, valid_BKT: jax.Array, mu_BKD: jax.Array,
                   lo_BKD: jax.Array, step_BKD: jax.Array, bits: int) -> jax.Array:
  """code_BKTD: f32 codes clip(round((k - mu - lo) / step), 0, 2^bits - 1) (ties to even);
  invalid rows 0. With the stats of another set of keys (an append) the clip bounds keys outside
  that set's range."""
  k_BKTD = k_BKTD.astype(jnp.float32)
  levels = float((1 << bits) - 1)
  kc_BKTD = k_BKTD - mu_BKD[:, :, None]
  inv_step_BKD = 1.0 / step_BKD  # (see quantize_stats)
  code_BKTD = jnp.clip(jnp.round((kc_BKTD - lo_BKD[:, :, None]) * inv_step_BKD[:, :, None]), 0.0,
                       levels)
  return jnp.where(valid_BKT[..., None], code_BKTD, 0.0)


def quantize_with_stats(k_BKTD: jax.Array, valid_BKT: jax.Array, mu_BKD: jax.Array,
                        lo_BKD: jax.Array, step_BKD: jax.Array, bits: int) -> jax.Array:
  """kq_BKTD: f32 dequantized centred keys lo + code * step (`quantize_codes`); invalid rows 0."""
  code_BKTD = quantize_codes(k_BKTD, valid_BKT, mu_BKD, lo_BKD, step_BKD, bits)
  return jnp.where(valid_BKT[..., None], lo_BKD[:, :, None] + code_BKTD * step_BKD[:, :, None],
                   0.0)


class ProxyIndex(NamedTuple):
  """A pool's proxy index: mu_BKD, lo_BKD, step_BKD (`quantize_stats`) and code_BKTD
  (`quantize_codes`, f32 integers)."""
  mu: jax.Array
  lo: jax.Array
  step: jax.Array
  code: jax.Array


def build_index(k_BKTD: jax.Array, valid_BKT: jax.Array, bits: int) -> ProxyIndex:
  """The proxy index of a pool (its own statistics)."""
  mu, lo, step = quantize_stats(k_BKTD, valid_BKT, bits)
  return ProxyIndex(mu, lo, step, quantize_codes(k_BKTD, valid_BKT, mu, lo, step, bits))


def query_weights(w, xp=jnp):
  """(wq, sw): w [..., D] rounded to integers in [-127, 127] on a power-of-two grid per row,
  wq = clip(round(w * 2^(7 - x)), -127, 127) and sw = 2^(x - 7) where max|w| = f 2^x, f in
  [0.5, 1) (frexp; x = 0 for a zero row). Scaling by a power of two is exact, so numpy, jnp and
  the C++ kernel (QuantizeQueryWeights in xla_ffi/proxy.h) round the same float32 w alike.
  `xp` is jnp or numpy."""
  m = xp.max(xp.abs(w), axis=-1, keepdims=True)
  _, x = xp.frexp(m)
  wq = xp.clip(xp.round(w * xp.ldexp(xp.ones_like(m), 7 - x)), -127, 127)
  return wq, xp.ldexp(xp.ones_like(m), x - 7)


def quantize_keys(k_BKTD: jax.Array, valid_BKT: jax.Array,
                  bits: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Centres the pool keys and quantizes them per channel to 2^bits uniform levels (the stats of
  `quantize_stats` applied by `quantize_with_stats`).

  Returns:
    mu_BKD: mean of the valid keys (0 for an empty pool).
    kq_BKTD: f32 dequantized centred keys (what the index stores, as values); invalid rows 0.
    step_BKD: f32 quantization step per channel (for tests and the error bound |kq - k~| <=
      step / 2).
  """
  mu_BKD, lo_BKD, step_BKD = quantize_stats(k_BKTD, valid_BKT, bits)
  return mu_BKD, quantize_with_stats(k_BKTD, valid_BKT, mu_BKD, lo_BKD, step_BKD, bits), step_BKD


def pool_mean_values(v_BKTD: jax.Array, valid_BKT: jax.Array) -> jax.Array:
  """vbar_BKD: mean V over the valid pool (0 for an empty pool): the tail's value estimate."""
  n_BK1 = jnp.sum(valid_BKT, axis=-1, dtype=jnp.float32)[..., None]
  return jnp.sum(jnp.where(valid_BKT[..., None], v_BKTD.astype(jnp.float32), 0.0),
                 axis=2) / jnp.maximum(n_BK1, 1.0)


def keep_count(fraction: float, pool_B: jax.Array) -> jax.Array:
  """k_keep per slot: ceil(fraction * pool size), at least 1 when the pool is not empty."""
  pool_B = pool_B.astype(jnp.int32)
  k_B = jnp.ceil(fraction * pool_B.astype(jnp.float32)).astype(jnp.int32)
  return jnp.clip(k_B, jnp.minimum(pool_B, 1), pool_B)


def proxy_attention_ref(q_BHD: jax.Array, k_BKTD: jax.Array, v_BKTD: jax.Array,
                        valid_BKT: jax.Array, index: ProxyIndex, vbar_BKD: jax.Array,
                        k_keep_B: jax.Array, k_max: int, *, tail: str = "mean",
                        scale: float | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Proxy top-k attention over the pool (module docstring, steps 2-4).

  Args:
    q_BHD: queries. k_BKTD, v_BKTD: pool keys (post-RoPE, raw) and values. valid_BKT: bool.
    index: from `build_index` (or `quantize_stats` + `quantize_codes`). vbar_BKD: from
      `pool_mean_values`.
    k_keep_B: int32 rows read per query head, per slot (<= the slot's valid pool size).
    k_max: static upper bound of k_keep_B (the top_k width), >= 1.
    tail: one of PROXY_TAILS.
    scale: score scale, default 1/sqrt(D).

  Returns:
    o_BHD f32, lse_BH f32 (-inf and o = 0 for an empty pool), count_BH int32: pool rows read.
  """
  if tail not in PROXY_TAILS:
    raise ValueError(f"proxy tail must be one of {PROXY_TAILS}, got {tail!r}.")
  reference.check_finite("proxy_attention_ref", q=q_BHD, k=(k_BKTD, valid_BKT), v=(v_BKTD, valid_BKT))
  num_kv = k_BKTD.shape[1]
  q_BKGD = reference.group_heads(q_BHD, num_kv).astype(jnp.float32)
  if scale is None:
    scale = 1.0 / (q_BKGD.shape[-1] ** 0.5)
  # Ranking scores: the exact integer scan scaled by a power of two (query_weights); the bias
  # scale * (q . lo + q . mu), the same for every token of a head, joins for the tail only.
  wq_BKGD, sw_BKG1 = query_weights(scale * q_BKGD * index.step[:, :, None])
  isum_BKGT = jnp.einsum("bkgd,bktd->bkgt", wq_BKGD.astype(jnp.int32),
                         index.code.astype(jnp.int32), preferred_element_type=jnp.int32)
  raw_BKGT = isum_BKGT.astype(jnp.float32) * sw_BKG1
  bias_BKG = scale * jnp.einsum("bkgd,bkd->bkg", q_BKGD, (index.lo + index.mu).astype(jnp.float32),
                                precision=_HIGHEST)
  valid_BKGT = jnp.broadcast_to(valid_BKT[:, :, None], raw_BKGT.shape)
  raw_BKGT = jnp.where(valid_BKGT, raw_BKGT, -jnp.inf)
  width = max(1, min(k_max, raw_BKGT.shape[-1]))
  top_BKGW = jax.lax.top_k(raw_BKGT, width)[0]
  idx_B = jnp.clip(k_keep_B - 1, 0, width - 1)
  kth_BKG = jnp.take_along_axis(top_BKGW, idx_B[:, None, None, None], axis=-1)[..., 0]
  keep_BKGT = valid_BKGT & (raw_BKGT >= kth_BKG[..., None]) & (k_keep_B > 0)[:, None, None, None]

  s_BKGT = reference.head_scores(q_BKGD, k_BKTD, scale)
  o_BKGD, lse_BKG = reference.masked_attention(s_BKGT, keep_BKGT, v_BKTD)
  if tail == "mean":
    rest_BKGT = valid_BKGT & ~keep_BKGT
    _, lse_rest_BKG = reference.masked_attention(raw_BKGT, rest_BKGT, v_BKTD[..., :1])
    lse_rest_BKG = lse_rest_BKG + bias_BKG
    vbar_BKGD = jnp.broadcast_to(vbar_BKD[:, :, None].astype(jnp.float32), o_BKGD.shape)
    o_BKGD, lse_BKG = merge_attention(o_BKGD, lse_BKG, vbar_BKGD, lse_rest_BKG)
  o_BHD, lse_BH = reference.ungroup_heads(o_BKGD, lse_BKG)
  b, k, g, t = keep_BKGT.shape
  return o_BHD, lse_BH, jnp.sum(keep_BKGT.reshape(b, k * g, t), axis=-1, dtype=jnp.int32)


def index_bytes_per_token(bits: int, head_dim: int) -> int:
  """Index bytes per pool token and KV head that the proxy store keeps and scans every step
  (xla_ffi/proxy.h ProxyLayout): bits <= 4 pack two channels a byte, bits 5..8 one, and channels
  are padded to groups of 16 (8 for bytes). 1-3 bits therefore cost what 4 do on the host."""
  if bits <= 4:
    return -(-head_dim // 16) * 8
  return -(-head_dim // 8) * 8


@register("proxy")
class ProxyEstimator:
  """The decode-path strategy: the store quantizes the centred keys into its index itself
  (xla_ffi/estimator_proxy.h), so nothing is hashed and every codes operand has 0 columns; the
  strategy computes only the pool's mean key."""
  runs_on_mesh = False  # its store is not tested under shard_map yet

  def __init__(self, a: AttentionConfig, head_dim: int):
    self.a, self.head_dim = a, head_dim

  def layer_matrix(self, layer: int):
    return None

  def index(self, k_BKPD, valid_BKP, w):
    return pool_mean_values(k_BKPD, valid_BKP), jnp.zeros(k_BKPD.shape[:3] + (0,), jnp.int32)

  def append_codes(self, k_BKTD, mu_BKD, w):
    return jnp.zeros(k_BKTD.shape[:3] + (0,), jnp.int32)

  def query_codes(self, q_BHD, w):
    return jnp.zeros(q_BHD.shape[:2] + (0,), jnp.int32)

  def stats(self) -> dict:
    """The index it scans every step, per pool token and KV head (its lookup cost)."""
    return {"index_bytes_per_token": index_bytes_per_token(self.a.proxy_bits, self.head_dim)}
