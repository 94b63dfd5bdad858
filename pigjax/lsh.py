"""Pure-jnp reference of MagicPIG's LSH-sampled attention (docs/design.md, "The algorithm").

MagicPIG ("LSH Sampling for Efficient LLM Generation", arXiv 2410.16179, ICLR 2025) replaces
attention over the long middle of the context (the *pool*) by a self-normalised importance-sampling
estimate. SimHash tables pick the keys that collide with the query in at least 2 of L tables; each
sampled key's score is corrected by -log u_i, u_i its probability of being sampled; and keys are
centred on their mean before hashing, without which almost nothing collides (paper section 5.3).
The pool estimate is merged with exact attention over sink, window and generated tokens by
log-sum-exp. docs/design.md, "The algorithm", gives every formula used here, numbered as its steps.

Everything here is mask-based over the whole pool: O(n) per query, batch and heads vectorised,
static shapes, jit-able. It is the oracle for the C++ FFI kernel and the engine of the quality
harness, so it favours clarity and numerical care over speed.

Shape letters (written once, used in names and einsums):
  B batch, H query heads, K kv heads, G query heads per kv head (H = K * G),
  T pool (or context) tokens, D head dim, L hash tables (`num_tables`).
The number of bits per table is always spelled `num_bits`; it never appears as a shape letter.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Floor on the sampling probability u_i. A candidate nearly anti-parallel to the query (cos -> -1,
# p -> 0) has P = p^num_bits far below f32's range; computed naively u underflows to 0 and
# -log(0) = inf turns the softmax into inf/NaN. The log-space formula below avoids underflow except
# at p == 0 exactly, and the floor bounds the weight of such (astronomically unlikely) candidates.
U_FLOOR = 1e-30
LOG_U_FLOOR = math.log(U_FLOOR)

# Below L * P = _SERIES_MAX, u is computed from its binomial series (the closed form cancels
# catastrophically there); the first omitted term is < (0.1)^5 / 2520 ~ 4e-9 relative.
_SERIES_MAX = 0.1
_SERIES_TERMS = 4  # j = 3..6 after the leading j = 2 term

_HIGHEST = jax.lax.Precision.HIGHEST


def simhash_matrix(seed: int, layer: int, head_dim: int, num_bits: int, num_tables: int,
                   per_layer: bool = True) -> jax.Array:
  """The SimHash projection W (docs/design.md, "The algorithm", step 3): standard Gaussian,
  deterministic in the seed.

  Args:
    seed: the config's hash seed.
    layer: layer index; folded into the key when `per_layer`, ignored otherwise.
    head_dim: D.
    num_bits: bits per table.
    num_tables: number of tables.
    per_layer: one matrix per layer (True) or one shared by all layers.

  Returns:
    w: f32 [D, num_bits * num_tables]; columns t*num_bits .. t*num_bits+num_bits-1 are table t.
  """
  key = jax.random.PRNGKey(seed)
  if per_layer:
    key = jax.random.fold_in(key, layer)
  return jax.random.normal(key, (head_dim, num_bits * num_tables), jnp.float32)


def hash_codes(x: jax.Array, w: jax.Array, num_bits: int, num_tables: int) -> jax.Array:
  """SimHash codes: code_t(x) = sum_{j<num_bits} [x . w[:, t*num_bits+j] > 0] * 2^j.

  Args:
    x: [..., D] vectors (any float dtype; projected in f32 at full precision so that the signs
      agree across backends).
    w: f32 [D, num_bits * num_tables] from `simhash_matrix`.

  Returns:
    codes: int32 [..., num_tables], each in [0, 2^num_bits).
  """
  if w.shape != (x.shape[-1], num_bits * num_tables):
    raise ValueError(f"hash matrix has shape {w.shape}; expected (head_dim, num_bits * num_tables)"
                     f" = ({x.shape[-1]}, {num_bits * num_tables})")
  proj = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision=_HIGHEST)
  bits = (proj > 0).reshape(*x.shape[:-1], num_tables, num_bits).astype(jnp.int32)
  return jnp.sum(bits << jnp.arange(num_bits, dtype=jnp.int32), axis=-1, dtype=jnp.int32)


def centre_and_hash(k_BKTD: jax.Array, valid_BKT: jax.Array, w: jax.Array, num_bits: int,
                    num_tables: int) -> tuple[jax.Array, jax.Array]:
  """Centres pool keys on their mean and hashes them (docs/design.md, "The algorithm", steps 2-3;
  paper section 5.3).

  Args:
    k_BKTD: pool keys (post-RoPE).
    valid_BKT: bool, which pool slots hold a token.
    w: SimHash matrix.

  Returns:
    mu_BKD: f32 mean of the valid keys (0 where a pool is empty).
    codes_BKTL: int32 codes of k - mu. Rows with valid == False are hashed like the others (codes
      of whatever they hold, minus mu); they are meaningless and must be masked by the caller.
  """
  k_BKTD = k_BKTD.astype(jnp.float32)
  mask_BKT1 = valid_BKT[..., None]
  count_BK1 = jnp.sum(valid_BKT, axis=-1, dtype=jnp.float32)[..., None]
  mu_BKD = jnp.sum(jnp.where(mask_BKT1, k_BKTD, 0.0), axis=2) / jnp.maximum(count_BK1, 1.0)
  codes_BKTL = hash_codes(k_BKTD - mu_BKD[:, :, None], w, num_bits, num_tables)
  return mu_BKD, codes_BKTL


def log_collision_probability(cos: jax.Array, num_bits: int, num_tables: int) -> jax.Array:
  """log u, u = P(at least 2 of num_tables tables collide), without underflow or cancellation.

  p = 1 - arccos(cos)/pi; P = p^num_bits; with L = num_tables,
  u = 1 - (1-P)^L - L P (1-P)^(L-1) = 1 - (1-P)^(L-1) (1 + (L-1) P).
  For L P >= 0.1: log(-expm1((L-1) log1p(-P) + log1p((L-1) P))).
  For L P <  0.1: the binomial series sum_{j=2..6} C(L,j) P^j (1-P)^(L-j), taken in log space
  (log P = num_bits log p never underflows). Returns -inf only where p == 0 (cos == -1).

  Args:
    cos: cosine between query and centred key, any shape; clamped to [-1, 1].

  Returns:
    f32 log u, same shape.
  """
  if num_tables < 2:
    raise ValueError(f"num_tables must be >= 2 (candidates need 2 collisions), got {num_tables}")
  lt = float(num_tables)
  cos = jnp.clip(jnp.asarray(cos, jnp.float32), -1.0, 1.0)
  p = 1.0 - jnp.arccos(cos) / jnp.pi
  pos = p > 0
  log_p_big = num_bits * jnp.log(jnp.where(pos, p, 1.0))
  big_p = jnp.exp(log_p_big)  # P
  series = lt * big_p < _SERIES_MAX
  # Closed form (where-guarded so the unused branch never produces NaN).
  pc = jnp.where(series, 0.5, big_p)
  arg = (lt - 1.0) * jnp.log1p(-jnp.minimum(pc, 1.0 - 1e-7)) + jnp.log1p((lt - 1.0) * pc)
  arg = jnp.where(pc >= 1.0, -jnp.inf, arg)  # P == 1: every table collides, u = 1
  log_u_closed = jnp.log(-jnp.expm1(jnp.minimum(arg, -1e-30)))
  # Series: term_j / term_2 = prod_{i=3..j} (L-i+1)/i * P/(1-P).
  ps = jnp.where(series, big_p, 0.0)
  ratio = ps / (1.0 - ps)
  term, rest = jnp.ones_like(ps), jnp.zeros_like(ps)
  for j in range(3, 3 + _SERIES_TERMS):
    term = term * (max(lt - j + 1.0, 0.0) / j) * ratio
    rest = rest + term
  log_u_series = (math.log(lt * (lt - 1.0) / 2.0) + 2.0 * log_p_big + (lt - 2.0) * jnp.log1p(-ps)
                  + jnp.log1p(rest))
  log_u = jnp.where(series, log_u_series, log_u_closed)
  return jnp.where(pos, log_u, -jnp.inf)


def collision_probability(cos: jax.Array, num_bits: int, num_tables: int) -> jax.Array:
  """u = 1 - (1-P)^L - L P (1-P)^(L-1), P = (1 - arccos(cos)/pi)^num_bits (docs/design.md,
  "The algorithm", step 6)."""
  return jnp.exp(log_collision_probability(cos, num_bits, num_tables))


def expected_candidate_fraction(num_bits: int, num_tables: int) -> float:
  """Expected fraction of the pool sampled for random directions (P = 0.5^num_bits)."""
  big_p, lt = 0.5 ** num_bits, num_tables
  return 1.0 - (1.0 - big_p) ** lt - lt * big_p * (1.0 - big_p) ** (lt - 1)


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
