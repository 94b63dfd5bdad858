"""Pure-jnp references of the pool attentions (docs/design.md, "The algorithm"): MagicPIG's
LSH-sampled estimate, dense and oracle top-k attention, and the host store's storage formats.

The pool estimate is merged with exact attention over sink, window and generated tokens by
log-sum-exp (`attention.merge_attention`). Everything here is mask-based over the whole pool: O(n)
per query, batch and heads vectorised, static shapes, jit-able. It is the oracle for the C++ FFI
kernel and the engine of the quality harness (`pigjax.eval`), so it favours clarity and numerical
care over speed; the decode path never calls it.

Shape letters: B batch, H query heads, K kv heads, G query heads per kv head (H = K * G),
T pool (or context) tokens, D head dim, L hash tables (`num_tables`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pigjax.lsh import LOG_U_FLOOR, hash_codes, log_collision_probability

_HIGHEST = jax.lax.Precision.HIGHEST


def masked_attention(s_BKGT: jax.Array, mask_BKGT: jax.Array,
                      v_BKTD: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Softmax of s over the masked tokens, applied to v; empty mask -> o = 0, lse = -inf.

  Returns o_BKGD f32 and lse_BKG f32. Every exp/log/divide is where-guarded so an empty set
  produces no inf - inf, 0/0 or NaN (in values or gradients).
  """
  s_BKGT = jnp.where(mask_BKGT, s_BKGT, -jnp.inf)
  m_BKG = jnp.max(s_BKGT, axis=-1)
  m_BKG = jnp.where(jnp.isfinite(m_BKG), m_BKG, 0.0)
  e_BKGT = jnp.where(mask_BKGT, jnp.exp(jnp.where(mask_BKGT, s_BKGT - m_BKG[..., None], 0.0)), 0.0)
  z_BKG = jnp.sum(e_BKGT, axis=-1)
  nonempty = z_BKG > 0
  o_BKGD = jnp.einsum("bkgt,bktd->bkgd", e_BKGT, v_BKTD.astype(jnp.float32), precision=_HIGHEST)
  o_BKGD = o_BKGD / jnp.where(nonempty, z_BKG, 1.0)[..., None]
  lse_BKG = jnp.where(nonempty, m_BKG + jnp.log(jnp.where(nonempty, z_BKG, 1.0)), -jnp.inf)
  return o_BKGD, lse_BKG


def group_heads(q_BHD: jax.Array, num_kv_heads: int) -> jax.Array:
  """GQA: query head h uses kv head h // G, so [B, H, D] -> [B, K, G, D]."""
  b, h, d = q_BHD.shape
  if h % num_kv_heads:
    raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({num_kv_heads})")
  return q_BHD.astype(jnp.float32).reshape(b, num_kv_heads, h // num_kv_heads, d)


def head_scores(q_BKGD: jax.Array, k_BKTD: jax.Array, scale: float | None) -> jax.Array:
  if scale is None:
    scale = 1.0 / math.sqrt(q_BKGD.shape[-1])
  return jnp.einsum("bkgd,bktd->bkgt", q_BKGD, k_BKTD.astype(jnp.float32),
                    precision=_HIGHEST) * scale


def ungroup_heads(o_BKGD: jax.Array, lse_BKG: jax.Array) -> tuple[jax.Array, jax.Array]:
  b, k, g, d = o_BKGD.shape
  return o_BKGD.reshape(b, k * g, d), lse_BKG.reshape(b, k * g)


def candidate_mask(q_BHD: jax.Array, codes_BKTL: jax.Array, valid_BKT: jax.Array, w: jax.Array,
                   num_bits: int, num_tables: int) -> jax.Array:
  """Valid pool tokens colliding with the (uncentred) query in >= 2 tables (docs/design.md, "The
  algorithm", step 5).

  Returns:
    cand_BHT: bool.
  """
  q_BKGD = group_heads(q_BHD, codes_BKTL.shape[1])
  qcodes_BKGL = hash_codes(q_BKGD, w, num_bits, num_tables)
  hits_BKGT = jnp.sum(codes_BKTL[:, :, None] == qcodes_BKGL[:, :, :, None], axis=-1,
                      dtype=jnp.int32)
  cand_BKGT = (hits_BKGT >= 2) & valid_BKT[:, :, None]
  b, k, g, t = cand_BKGT.shape
  return cand_BKGT.reshape(b, k * g, t)


def quantize_int8_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The host store's int8 K/V format (xla_ffi/store.h CopyTokens): per row (last axis) a float32
  scale max|x| x float32(1/127) (1 for an all-zero row) and round(x x (1 / scale)), ties to even,
  in [-127, 127].

  Returns (x8 int8 [..., D], scale f32 [...]).
  """
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=-1)
  # amax times the float32 1/127, not amax / 127: XLA rewrites a division by a constant into that
  # product, and the C++ side must round the same way.
  scale = jnp.where(amax > 0, amax * jnp.float32(1 / 127), jnp.float32(1))
  # x times 1/scale rather than x / scale, for the same reason (XLA:CPU divides that way).
  inv = jnp.float32(1) / scale
  x8 = jnp.clip(jnp.round(x * inv[..., None]), -127, 127).astype(jnp.int8)
  return x8, scale


def stored_values(x: jax.Array, store_dtype: str) -> jax.Array:
  """What the host store holds for K or V rows x stored as `store_dtype`, as float32: the
  kernel's twin reads these (codes and the mean still come from the unrounded keys)."""
  if store_dtype == "int8":
    x8, scale = quantize_int8_rows(x)
    return x8.astype(jnp.float32) * scale[..., None]
  if store_dtype == "bfloat16":
    return x.astype(jnp.bfloat16).astype(jnp.float32)
  if store_dtype == "float32":
    return x.astype(jnp.float32)
  raise ValueError(f"store_dtype must be 'bfloat16', 'float32' or 'int8', got {store_dtype!r}.")


def check_finite(fn: str, **operands) -> None:
  """Non-finite policy, shared with the host store (xla_ffi/store.h): a NaN or +-Inf in a query,
  key, value or mean is an error that names the operand and its first bad index.

  The store's FFI calls raise it at run time. This pure-jnp reference raises the same ValueError
  when called on concrete arrays; under `jax.jit` (tracers) it cannot raise, checks nothing and
  the NaN propagates into o and lse. An operand may be given as (array, valid mask) so that only
  valid entries count, as the store reads only the first `lengths` tokens of an insert.
  """
  import numpy as np  # only for the eager check

  for name, x in operands.items():
    x, valid = x if isinstance(x, tuple) else (x, None)
    if isinstance(x, jax.core.Tracer) or isinstance(valid, jax.core.Tracer):
      continue
    bad = ~np.isfinite(np.asarray(x, np.float32))
    if valid is not None:
      bad &= np.broadcast_to(np.asarray(valid)[..., None], bad.shape)
    if bad.any():
      idx = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(f"{fn}: {name}{list(idx)} = {np.asarray(x, np.float32)[idx]} is not "
                       "finite; only finite keys, values, means and queries are accepted.")


def pool_attention_ref(q_BHD: jax.Array, k_BKTD: jax.Array, v_BKTD: jax.Array,
                       valid_BKT: jax.Array, mu_BKD: jax.Array, w: jax.Array, num_bits: int,
                       num_tables: int, *, codes_BKTL: jax.Array | None = None,
                       scale: float | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Importance-weighted sampled attention over the pool (docs/design.md, "The algorithm", steps
  5-8).

  Candidates S: valid pool tokens whose code(k - mu) equals code(q) (q not centred) in >= 2
  tables. For i in S: cos_i = q.(k_i - mu) / (|q| |k_i - mu|), u_i = max(collision prob, U_FLOOR),
  s_i = scale * q.k_i - log u_i (raw keys; scale defaults to 1/sqrt(D), and the exact part must use
  raw keys too). o = softmax(s over S) @ v, lse = logsumexp(s over S).

  Args:
    q_BHD: queries. k_BKTD, v_BKTD: pool keys (post-RoPE) and values. valid_BKT: bool.
    mu_BKD: pool key mean (from `centre_and_hash`). w: SimHash matrix.
    codes_BKTL: precomputed codes of k - mu (optional; computed here when None).
    scale: score scale, default 1/sqrt(D).

  Returns:
    o_BHD f32 (0 where S is empty), lse_BH f32 (-inf where S is empty), count_BH int32 = |S|.

  Raises:
    ValueError: a non-finite q, valid k or v, or mu, on concrete inputs (see `check_finite`).
  """
  check_finite("pool_attention_ref", q=q_BHD, k=(k_BKTD, valid_BKT), v=(v_BKTD, valid_BKT),
               mu=mu_BKD)
  num_kv = k_BKTD.shape[1]
  kc_BKTD = k_BKTD.astype(jnp.float32) - mu_BKD.astype(jnp.float32)[:, :, None]
  if codes_BKTL is None:
    codes_BKTL = hash_codes(kc_BKTD, w, num_bits, num_tables)
  cand_BHT = candidate_mask(q_BHD, codes_BKTL, valid_BKT, w, num_bits, num_tables)
  b, h, t = cand_BHT.shape
  cand_BKGT = cand_BHT.reshape(b, num_kv, h // num_kv, t)
  q_BKGD = group_heads(q_BHD, num_kv)

  dot_BKGT = jnp.einsum("bkgd,bktd->bkgt", q_BKGD, kc_BKTD, precision=_HIGHEST)
  qn_BKG = jnp.linalg.norm(q_BKGD, axis=-1)
  kn_BKT = jnp.linalg.norm(kc_BKTD, axis=-1)
  denom_BKGT = qn_BKG[..., None] * kn_BKT[:, :, None]
  cos_BKGT = jnp.where(denom_BKGT > 0, dot_BKGT / jnp.where(denom_BKGT > 0, denom_BKGT, 1.0), 0.0)
  log_u_BKGT = jnp.maximum(log_collision_probability(cos_BKGT, num_bits, num_tables), LOG_U_FLOOR)

  s_BKGT = head_scores(q_BKGD, k_BKTD, scale) - log_u_BKGT
  o_BKGD, lse_BKG = masked_attention(s_BKGT, cand_BKGT, v_BKTD)
  o_BHD, lse_BH = ungroup_heads(o_BKGD, lse_BKG)
  return o_BHD, lse_BH, jnp.sum(cand_BHT, axis=-1, dtype=jnp.int32)


def dense_attention_ref(q_BHD: jax.Array, k_BKTD: jax.Array, v_BKTD: jax.Array,
                        valid_BKT: jax.Array,
                        scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  """Ordinary GQA softmax attention over the valid tokens (docs/design.md, "The algorithm", step 9).

  Returns:
    o_BHD f32 (0 where no token is valid), lse_BH f32 (-inf where none is valid).
  """
  q_BKGD = group_heads(q_BHD, k_BKTD.shape[1])
  s_BKGT = head_scores(q_BKGD, k_BKTD, scale)
  return ungroup_heads(*masked_attention(s_BKGT, jnp.broadcast_to(valid_BKT[:, :, None], s_BKGT.shape),
                                     v_BKTD))


def topk_attention_ref(q_BHD: jax.Array, k_BKTD: jax.Array, v_BKTD: jax.Array,
                       valid_BKT: jax.Array, k_keep: int,
                       scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  """Oracle top-k attention: softmax over the k_keep highest-scoring valid tokens per query head.

  Tokens tied with the k_keep-th score are all kept. Returns o_BHD f32, lse_BH f32 as
  `dense_attention_ref`.
  """
  q_BKGD = group_heads(q_BHD, k_BKTD.shape[1])
  s_BKGT = head_scores(q_BKGD, k_BKTD, scale)
  valid_BKGT = jnp.broadcast_to(valid_BKT[:, :, None], s_BKGT.shape)
  masked_BKGT = jnp.where(valid_BKGT, s_BKGT, -jnp.inf)
  k_keep = min(k_keep, s_BKGT.shape[-1])
  kth_BKG = jax.lax.top_k(masked_BKGT, k_keep)[0][..., -1]
  keep_BKGT = valid_BKGT & (masked_BKGT >= kth_BKG[..., None])
  return ungroup_heads(*masked_attention(s_BKGT, keep_BKGT, v_BKTD))
