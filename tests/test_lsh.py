"""Tests of the pure-jnp MagicPIG reference (pigjax/lsh.py) against independent numpy loops and
against the probabilities it claims (docs/design.md, "The algorithm").

Shape letters as in pigjax/lsh.py: B batch, H query heads, K kv heads, T tokens, D head dim,
L tables.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pigjax import attention, lsh, reference


# ----------------------------------------------------------------------------- numpy references


def np_codes(x, w, num_bits, num_tables):
  """code_t(x) = sum_j [x . w[:, t*num_bits+j] > 0] * 2^j, one loop iteration per bit."""
  x = np.asarray(x, np.float64)
  w = np.asarray(w, np.float64)
  out = np.zeros(x.shape[:-1] + (num_tables,), np.int64)
  for t in range(num_tables):
    for j in range(num_bits):
      out[..., t] += (x @ w[:, t * num_bits + j] > 0).astype(np.int64) << j
  return out


def np_u(cos, num_bits, num_tables):
  """The formula of docs/design.md, "The algorithm", step 6, verbatim, in float64."""
  p = 1.0 - math.acos(min(max(cos, -1.0), 1.0)) / math.pi
  big_p, lt = p ** num_bits, num_tables
  return 1.0 - (1.0 - big_p) ** lt - lt * big_p * (1.0 - big_p) ** (lt - 1)


def np_pool_attention(q, k, v, valid, w, num_bits, num_tables):
  """docs/design.md, "The algorithm", steps 2 and 5-8, one (batch, head, token) at a time."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  valid = np.asarray(valid)
  b_, h_, d_ = q.shape
  kv_ = k.shape[1]
  o = np.zeros((b_, h_, d_))
  lse = np.full((b_, h_), -np.inf)
  count = np.zeros((b_, h_), np.int64)
  for b in range(b_):
    for h in range(h_):
      kv = h // (h_ // kv_)
      idx = np.nonzero(valid[b, kv])[0]
      mu = k[b, kv, idx].mean(0) if len(idx) else np.zeros(d_)
      qc = np_codes(q[b, h], w, num_bits, num_tables)
      scores, rows = [], []
      for i in idx:
        kc = k[b, kv, i] - mu
        if np.sum(np_codes(kc, w, num_bits, num_tables) == qc) < 2:
          continue
        cos = q[b, h] @ kc / (np.linalg.norm(q[b, h]) * np.linalg.norm(kc))
        u = max(np_u(cos, num_bits, num_tables), lsh.U_FLOOR)
        scores.append(q[b, h] @ k[b, kv, i] / math.sqrt(d_) - math.log(u))
        rows.append(v[b, kv, i])
      count[b, h] = len(scores)
      if scores:
        s = np.array(scores)
        m = s.max()
        e = np.exp(s - m)
        o[b, h] = e @ np.array(rows) / e.sum()
        lse[b, h] = m + math.log(e.sum())
  return o, lse, count


def np_dense(q, k, v, valid):
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b_, h_, d_ = q.shape
  g = h_ // k.shape[1]
  o, lse = np.zeros((b_, h_, d_)), np.full((b_, h_), -np.inf)
  for b in range(b_):
    for h in range(h_):
      idx = np.nonzero(np.asarray(valid)[b, h // g])[0]
      if len(idx):
        s = k[b, h // g, idx] @ q[b, h] / math.sqrt(d_)
        e = np.exp(s - s.max())
        o[b, h] = e @ v[b, h // g, idx] / e.sum()
        lse[b, h] = s.max() + math.log(e.sum())
  return o, lse


def random_case(seed, b=2, h=4, kv=2, t=40, d=8, p_valid=0.8):
  r = np.random.default_rng(seed)
  q = jnp.asarray(r.normal(size=(b, h, d)), jnp.float32)
  k = jnp.asarray(r.normal(size=(b, kv, t, d)) + 0.5, jnp.float32)  # offset: centring matters
  v = jnp.asarray(r.normal(size=(b, kv, t, d)), jnp.float32)
  valid = jnp.asarray(r.random((b, kv, t)) < p_valid)
  return q, k, v, valid


# Jitted once per shape (op-by-op dispatch would compile every primitive separately), at LLVM
# optimisation level 0: these graphs run for milliseconds, and compiling them dominates the file.
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
_pool = _jit(reference.pool_attention_ref, static_argnums=(6, 7),
                static_argnames=("num_bits", "num_tables"))
_dense = _jit(reference.dense_attention_ref)
_topk = _jit(reference.topk_attention_ref, static_argnums=4)
_merge = _jit(attention.merge_attention)
_centre = _jit(lsh.centre_and_hash, static_argnums=(3, 4))
_log_u = _jit(lsh.log_collision_probability, static_argnums=(1, 2))


# ----------------------------------------------------------------------------- hashing


def test_hash_codes_match_numpy_loop():
  w = lsh.simhash_matrix(3, 1, 16, 5, 7)
  assert w.shape == (16, 35) and w.dtype == jnp.float32
  x = np.random.default_rng(0).normal(size=(3, 4, 16)).astype(np.float32)
  codes = lsh.hash_codes(jnp.asarray(x), w, 5, 7)
  assert codes.shape == (3, 4, 7) and codes.dtype == jnp.int32
  np.testing.assert_array_equal(codes, np_codes(x, w, 5, 7))


def test_simhash_matrix_deterministic_and_per_layer():
  a = lsh.simhash_matrix(7, 2, 32, 4, 3)
  np.testing.assert_array_equal(a, lsh.simhash_matrix(7, 2, 32, 4, 3))
  assert not np.array_equal(a, lsh.simhash_matrix(7, 3, 32, 4, 3))
  assert not np.array_equal(a, lsh.simhash_matrix(8, 2, 32, 4, 3))
  np.testing.assert_array_equal(lsh.simhash_matrix(7, 2, 32, 4, 3, per_layer=False),
                                lsh.simhash_matrix(7, 9, 32, 4, 3, per_layer=False))


def test_centre_and_hash():
  q, k, v, valid = random_case(1)
  w = lsh.simhash_matrix(0, 0, 8, 3, 4)
  valid = valid.at[1, 1].set(False)  # one empty pool
  mu, codes = _centre(k, valid, w, 3, 4)
  kn, vn = np.asarray(k), np.asarray(valid)
  for b in range(2):
    for h in range(2):
      want = kn[b, h, vn[b, h]].mean(0) if vn[b, h].any() else np.zeros(8)
      np.testing.assert_allclose(mu[b, h], want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(codes, np_codes(kn - np.asarray(mu)[:, :, None], w, 3, 4))


# ----------------------------------------------------------------------------- probabilities


def test_log_collision_probability_matches_float64_formula():
  cos = np.linspace(-0.99, 1.0, 397)
  for num_bits, num_tables in [(10, 150), (8, 75), (6, 20), (2, 3)]:
    log_u = np.asarray(_log_u(jnp.asarray(np.append(cos, -1.0)), num_bits, num_tables))
    assert log_u[-1] == -np.inf and log_u[-2] == 0.0  # cos = -1: p = 0; cos = 1: u = 1
    got = np.exp(log_u[:-1])
    # Exact binomial tail in float64 (the closed form cancels for tiny P).
    want = []
    for c in cos:
      big_p = (1.0 - math.acos(c) / math.pi) ** num_bits
      want.append(sum(math.comb(num_tables, j) * big_p ** j * (1 - big_p) ** (num_tables - j)
                      for j in range(2, num_tables + 1)))
    np.testing.assert_allclose(got, want, rtol=2e-4)  # f32 arccos near -1 dominates
  assert lsh.expected_candidate_fraction(10, 150) == pytest.approx(np_u(0.0, 10, 150), rel=1e-12)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _trial_collisions(q_2, k_A2, num_bits, num_tables, num_trials):
  """Collisions (>= 2 tables) of fixed pairs under num_trials independent hash matrices."""

  def one(i):
    w = lsh.simhash_matrix(0, i, 2, num_bits, num_tables)
    hits_AL = lsh.hash_codes(k_A2, w, num_bits, num_tables) == lsh.hash_codes(
        q_2, w, num_bits, num_tables)
    return jnp.sum(hits_AL, axis=-1) >= 2

  return jnp.sum(jax.lax.map(one, jnp.arange(num_trials), batch_size=1000), axis=0)


@pytest.mark.parametrize("num_bits,num_tables", [(10, 150), (6, 20)])
def test_collision_probability_monte_carlo(num_bits, num_tables):
  # The probability depends only on the angle, so D = 2 keeps each trial cheap; a fresh hash
  # matrix per trial makes the trials independent, so the count is exactly Binomial(N, u) and the
  # tolerance is 5 binomial std (8 comparisons in all).
  cos = np.array([-0.3, 0.0, 0.4, 0.8])
  n = 20000
  q = jnp.array([1.0, 0.0], jnp.float32)
  k = jnp.asarray(np.stack([cos, np.sqrt(1 - cos ** 2)], -1), jnp.float32)
  frac = np.asarray(_trial_collisions(q, k, num_bits, num_tables, n)) / n
  u = np.exp(np.asarray(_log_u(jnp.asarray(cos), num_bits, num_tables)))
  sigma = np.sqrt(u * (1 - u) / n)
  assert np.all(np.abs(frac - u) <= 5 * sigma + 1e-4), (frac, u, sigma)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _candidate_fraction(q_BHD, k_BKTD, w, num_bits, num_tables):
  valid_BKT = jnp.ones(k_BKTD.shape[:3], bool)
  mu_BKD, codes_BKTL = lsh.centre_and_hash(k_BKTD, valid_BKT, w, num_bits, num_tables)
  cand_BHT = reference.candidate_mask(q_BHD, codes_BKTL, valid_BKT, w, num_bits, num_tables)
  kc_BTD = (k_BKTD - mu_BKD[:, :, None])[:, 0]
  cos_BHT = jnp.einsum("bhd,btd->bht", q_BHD, kc_BTD) / (
      jnp.linalg.norm(q_BHD, axis=-1)[..., None] * jnp.linalg.norm(kc_BTD, axis=-1)[:, None])
  return jnp.mean(cand_BHT, axis=-1), jnp.mean(
      lsh.collision_probability(cos_BHT, num_bits, num_tables), axis=-1)


@pytest.mark.parametrize("num_bits,num_tables,orthogonal",
                         [(10, 150, True), (8, 75, True), (6, 20, True), (8, 75, False)])
def test_candidate_fraction(num_bits, num_tables, orthogonal):
  """Pool candidate fraction on random Gaussian keys and queries (D = 64, centred keys).

  expected_candidate_fraction assumes cos(q, k~) = 0 exactly. With orthogonal=True the keys are
  projected onto the complement of the queries' span (centring keeps them there), so it is the
  exact expectation. With isotropic keys at D = 64, cos spreads by ~1/sqrt(D) and, u being convex,
  the fraction is well above the formula (about 2.4x for (10, 150)); its expectation is then
  mean_i u(cos_i).

  Tolerance: 5 standard errors. Pairs sharing a hash matrix and a query are correlated, so the
  binomial std of the pooled count (T * groups trials) underestimates the spread (measured: by
  1.7-3.6x). The standard error is taken over the independent (hash matrix, query) groups
  instead, floored at that binomial std.
  """
  d, t, nq, seeds = 64, 8000, 8, 4
  fracs, expects = [], []
  for seed in range(seeds):
    r = np.random.default_rng(seed)
    q = r.normal(size=(nq, d))
    k = r.normal(size=(t, d))
    if orthogonal:
      basis = np.linalg.qr(q.T)[0]
      k = k - (k @ basis) @ basis.T
    w = lsh.simhash_matrix(seed, 0, d, num_bits, num_tables)
    frac, mean_u = _candidate_fraction(jnp.asarray(q[None], jnp.float32),
                                       jnp.asarray(k[None, None], jnp.float32), w, num_bits,
                                       num_tables)
    fracs.append(np.asarray(frac[0]))
    expects.append(np.asarray(mean_u[0]))
  fracs = np.concatenate(fracs)
  want = (lsh.expected_candidate_fraction(num_bits, num_tables) if orthogonal
          else float(np.mean(expects)))
  binom = math.sqrt(want * (1 - want) / (t * len(fracs)))
  se = max(np.std(fracs, ddof=1) / math.sqrt(len(fracs)), binom)
  assert abs(fracs.mean() - want) <= 5 * se, (fracs.mean(), want, se)
  if not orthogonal:
    assert fracs.mean() > 1.2 * lsh.expected_candidate_fraction(num_bits, num_tables)


# ----------------------------------------------------------------------------- attention


def test_pool_attention_matches_numpy_loop():
  # 2 bits x 6 tables: about half the pool is a candidate, with a wide spread of u.
  q, k, v, valid = random_case(2)
  w = lsh.simhash_matrix(5, 0, 8, 2, 6)
  mu, codes = _centre(k, valid, w, 2, 6)
  o, lse, count = _pool(q, k, v, valid, mu, w, 2, 6)
  o_np, lse_np, count_np = np_pool_attention(q, k, v, valid, w, 2, 6)
  np.testing.assert_array_equal(count, count_np)
  assert 0 < count_np.min() and count_np.max() < np.asarray(valid).sum(-1).max()
  np.testing.assert_allclose(o, o_np, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(lse, lse_np, rtol=1e-5, atol=1e-5)
  # Precomputed codes give the same answer.
  o2, lse2, _ = _pool(q, k, v, valid, mu, w, 2, 6, codes_BKTL=codes)
  np.testing.assert_allclose(o2, o, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(lse2, lse, rtol=1e-6, atol=1e-6)


def test_dense_topk_and_merge():
  q, k, v, valid = random_case(3)
  o, lse = _dense(q, k, v, valid)
  o_np, lse_np = np_dense(q, k, v, valid)
  np.testing.assert_allclose(o, o_np, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse, lse_np, rtol=1e-5, atol=1e-6)
  # Top-k with k_keep = T is dense; splitting the tokens in two and merging is dense.
  o_k, lse_k = _topk(q, k, v, valid, 40)
  np.testing.assert_allclose(o_k, o, rtol=1e-6, atol=1e-6)
  first = jnp.arange(40) < 13
  o_m, lse_m = _merge(*_dense(q, k, v, valid & first),
                                   *_dense(q, k, v, valid & ~first))
  np.testing.assert_allclose(o_m, o, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse_m, lse, rtol=1e-6, atol=1e-6)
  # Top-3 keeps the 3 best valid scores.
  o_3, _ = _topk(q, k, v, valid, 3)
  q, k, v, valid = (np.asarray(a) for a in (q, k, v, valid))
  s = np.einsum("bkgd,bktd->bkgt", q.reshape(2, 2, 2, 8), k)
  s = np.where(valid[:, :, None], s, -np.inf).reshape(2, 4, 40)
  keep = s >= np.sort(s, -1)[..., -3:-2]
  o_3np, _ = np_dense(q, k, v, np.zeros((2, 2, 40), bool))
  for b in range(2):
    for h in range(4):
      o_3np[b, h] = np_dense(q[b:b + 1, h:h + 1], k[b:b + 1, h // 2:h // 2 + 1],
                             v[b:b + 1, h // 2:h // 2 + 1], keep[b:b + 1, h:h + 1])[0][0, 0]
  np.testing.assert_allclose(o_3, o_3np, rtol=1e-5, atol=1e-6)


@_jit
def _empty_cases(q_BHD, k_BKTD, v_BKTD, valid_BKT, w):
  """(o, lse, count) of an empty pool, of an empty dense part and of a full pool whose codes never
  match the query's (G = 1), each merged with the exact part; plus a gradient through the last."""
  nb, nt = 3, 5
  exact = reference.dense_attention_ref(q_BHD, k_BKTD, v_BKTD, valid_BKT)
  none = jnp.zeros_like(valid_BKT)
  mu_none, _ = lsh.centre_and_hash(k_BKTD, none, w, nb, nt)
  mu, _ = lsh.centre_and_hash(k_BKTD, valid_BKT, w, nb, nt)
  miss = jnp.broadcast_to((lsh.hash_codes(q_BHD, w, nb, nt) ^ 1)[:, :, None],
                          k_BKTD.shape[:3] + (nt,))
  no_count = jnp.zeros(q_BHD.shape[:2], jnp.int32)
  parts = {
      "empty pool": reference.pool_attention_ref(q_BHD, k_BKTD, v_BKTD, none, mu_none, w, nb, nt),
      "empty dense": reference.dense_attention_ref(q_BHD, k_BKTD, v_BKTD, none) + (no_count,),
      "no candidates": reference.pool_attention_ref(q_BHD, k_BKTD, v_BKTD, valid_BKT, mu, w, nb, nt,
                                              codes_BKTL=miss),
  }
  merged = {name: (attention.merge_attention(*exact, o, lse), attention.merge_attention(o, lse, o, lse))
            for name, (o, lse, _) in parts.items()}

  def loss(q_BHD):
    o, lse, _ = reference.pool_attention_ref(q_BHD, k_BKTD, v_BKTD, valid_BKT, mu, w, nb, nt,
                                       codes_BKTL=miss)
    return jnp.sum(attention.merge_attention(*reference.dense_attention_ref(q_BHD, k_BKTD, v_BKTD,
                                                                valid_BKT), o, lse)[0])

  return exact, mu_none, parts, merged, jax.grad(loss)(q_BHD)


def test_empty_pool_and_no_candidates():
  q, k, v, valid = random_case(4, h=2, kv=2)
  w = lsh.simhash_matrix(0, 0, 8, 3, 5)
  exact, mu_none, parts, merged, grad = jax.tree.map(np.asarray,
                                                     _empty_cases(q, k, v, valid, w))
  assert np.all(mu_none == 0.0)  # the mean of nothing is 0, not NaN
  for name, (o, lse, count) in parts.items():
    assert np.all(count == 0) and np.all(lse == -np.inf) and np.all(o == 0.0), name
    (o_m, lse_m), (o_both, lse_both) = merged[name]
    np.testing.assert_array_equal(o_m, exact[0], err_msg=name)  # exactly the exact part
    np.testing.assert_array_equal(lse_m, exact[1], err_msg=name)
    assert np.all(o_both == 0.0) and np.all(lse_both == -np.inf), name
  assert np.all(np.isfinite(grad))  # no NaN leaks into gradients through the guards


@functools.partial(_jit, static_argnums=(5, 6))
def _merged_error(q_BHD, k_BKTD, v_BKTD, exact_BKT, seeds, num_bits, num_tables):
  """Relative L2 error of exact + pool (merged) vs dense attention, one per hash seed."""
  pool_BKT = ~exact_BKT
  o_d, _ = reference.dense_attention_ref(q_BHD, k_BKTD, v_BKTD, jnp.ones_like(exact_BKT))
  exact = reference.dense_attention_ref(q_BHD, k_BKTD, v_BKTD, exact_BKT)

  def one(seed):
    w = lsh.simhash_matrix(seed, 0, q_BHD.shape[-1], num_bits, num_tables)
    mu_BKD, codes_BKTL = lsh.centre_and_hash(k_BKTD, pool_BKT, w, num_bits, num_tables)
    o_p, lse_p, _ = reference.pool_attention_ref(q_BHD, k_BKTD, v_BKTD, pool_BKT, mu_BKD, w,
                                           num_bits, num_tables, codes_BKTL=codes_BKTL)
    o, _ = attention.merge_attention(*exact, o_p, lse_p)
    return jnp.linalg.norm(o - o_d) / jnp.linalg.norm(o_d)

  return jax.vmap(one)(seeds)


def test_estimator_converges_with_more_tables():
  # One sequence, 2 kv heads x 2 query heads; 4 sink + 32 window tokens exact, 2000 pooled.
  # Keys: Gaussian + a shared offset (so centring matters) + 1% tokens aligned with the queries
  # (so attention is far from uniform); values correlated with the aligned keys.
  d, t, num_bits = 64, 2036, 6
  r = np.random.default_rng(0)
  q_hat = r.normal(size=(2, 2, d))
  q_hat /= np.linalg.norm(q_hat, axis=-1, keepdims=True)
  q = 8.0 * q_hat
  k = r.normal(size=(2, t, d)) + 0.7 * r.normal(size=(2, 1, d))
  hot = r.random((2, t)) < 0.01
  k += hot[..., None] * 2.5 * q_hat.mean(1)[:, None]
  v = r.normal(size=(2, t, d)) + hot[..., None] * 2.0
  exact = (np.arange(t) < 4) | (np.arange(t) >= t - 32)
  args = [jnp.asarray(a[None], jnp.float32) for a in (q.reshape(4, d), k, v)]
  exact = jnp.broadcast_to(jnp.asarray(exact), (1, 2, t))
  errors = {num_tables: float(np.mean(_merged_error(*args, exact, jnp.arange(4), num_bits,
                                                    num_tables)))
            for num_tables in (20, 80, 300)}
  assert errors[20] > errors[80] > errors[300], errors
  assert errors[300] < 0.06, errors  # measured 0.039
