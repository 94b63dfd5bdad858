"""The estimator probe's numpy estimators (pigjax/eval/probe.py) compute what the jnp references
compute, so its frontier numbers describe the code the harness and the CLI run."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from pigjax import lsh, reference
from pigjax.estimators import proxy
from pigjax.eval import probe


def _pool(seed, t=300, d=16):
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(t, d)) + rng.normal(size=d)
  v = rng.normal(size=(t, d))
  q = rng.normal(size=(3, d)) * 2
  return q, k, v


def _ctx(d, w=None):
  return {"scale": 1.0 / math.sqrt(d), "simhash": lambda b, l: w,
          "q_abs_mean": np.ones(d)}


def test_probe_magicpig_matches_the_jnp_reference():
  q, k, v = _pool(0)
  d = k.shape[1]
  num_bits, num_tables = 3, 12
  w = np.asarray(lsh.simhash_matrix(0, 1, d, num_bits, num_tables), np.float64)
  est = probe.MagicPig(num_bits, num_tables)
  est.prepare(k, v, _ctx(d, w))
  valid = jnp.ones((1, 1, k.shape[0]), bool)
  k_j, v_j = jnp.asarray(k[None, None], jnp.float32), jnp.asarray(v[None, None], jnp.float32)
  mu, codes = lsh.centre_and_hash(k_j, valid, jnp.asarray(w, jnp.float32), num_bits, num_tables)
  o_ref, lse_ref, cnt_ref = reference.pool_attention_ref(
      jnp.asarray(q[None], jnp.float32), k_j, v_j, valid, mu, jnp.asarray(w, jnp.float32),
      num_bits, num_tables, codes_BKTL=codes)
  for h in range(3):
    o, lse, rows, lookup = est(q[h])
    assert rows == int(cnt_ref[0, h]) and rows > 0
    np.testing.assert_allclose(o, o_ref[0, h], atol=1e-4)
    np.testing.assert_allclose(lse, lse_ref[0, h], atol=1e-4)
    assert lookup >= 4 * 2 * rows  # each candidate id sits in >= 2 of the walked buckets


@pytest.mark.parametrize("tail", ["mean", "none"])
def test_probe_proxy_matches_the_jnp_reference(tail):
  q, k, v = _pool(1)
  d = k.shape[1]
  est = probe.ProxyTopK("q4", 9, tail)
  est.prepare(k, v, _ctx(d))
  valid = jnp.ones((1, 1, k.shape[0]), bool)
  k_j, v_j = jnp.asarray(k[None, None], jnp.float32), jnp.asarray(v[None, None], jnp.float32)
  o_ref, lse_ref, cnt_ref = proxy.proxy_attention_ref(
      jnp.asarray(q[None], jnp.float32), k_j, v_j, valid, proxy.build_index(k_j, valid, 4),
      proxy.pool_mean_values(v_j, valid), jnp.asarray([9]), 9, tail=tail)
  for h in range(3):
    o, lse, rows, lookup = est(q[h])
    assert rows == 9 == int(cnt_ref[0, h])
    assert lookup == 32 / 4 * k.shape[0]  # 4 bits x 16 channels per token, whole pool scanned
    np.testing.assert_allclose(o, o_ref[0, h], atol=1e-4)
    np.testing.assert_allclose(lse, lse_ref[0, h], atol=1e-4)


def test_probe_oracle_and_poisson_probabilities():
  q, k, v = _pool(2)
  d = k.shape[1]
  est = probe.Oracle(7)
  est.prepare(k, v, _ctx(d))
  valid = jnp.ones((1, 1, k.shape[0]), bool)
  o_ref, lse_ref = reference.topk_attention_ref(jnp.asarray(q[None], jnp.float32),
                                          jnp.asarray(k[None, None], jnp.float32),
                                          jnp.asarray(v[None, None], jnp.float32), valid, 7)
  o, lse, rows, _ = est(q[0])
  assert rows == 7
  np.testing.assert_allclose(o, o_ref[0, 0], atol=1e-4)
  # Inclusion probabilities of the tail sample: sum to the budget, capped at 1, monotone.
  w = np.exp(np.random.default_rng(3).normal(size=200) * 3)
  pi = probe._poisson_probs(w, 20.0)
  assert pi.sum() == pytest.approx(20.0, rel=1e-6) and pi.max() <= 1.0
  assert np.all(np.diff(pi[np.argsort(w)]) >= -1e-12)
