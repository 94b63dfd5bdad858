"""SimHash LSH for MagicPIG (docs/design.md, "The algorithm", steps 2-6): the projection matrices,
the codes of keys and queries, centring, and the collision probability u_i behind the importance
weights.

MagicPIG ("LSH Sampling for Efficient LLM Generation", arXiv 2410.16179, ICLR 2025) replaces
attention over the long middle of the context (the *pool*) by a self-normalised importance-sampling
estimate. SimHash tables pick the keys that collide with the query in at least 2 of L tables; each
sampled key's score is corrected by -log u_i, u_i its probability of being sampled; and keys are
centred on their mean before hashing, without which almost nothing collides (paper section 5.3).

The decode path (`pigjax.estimators.simhash`) hashes with these functions; the pure-jnp attention
references that the host kernel is tested against live in `pigjax.reference`.

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
