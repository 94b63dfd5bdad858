"""The proxy estimator (pigjax/proxy.py) against a plain numpy reference, its cost
accounting, its edge cases, and its selection through `attention.estimator`."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from pigjax.estimators import proxy
from pigjax.config import AttentionConfig, Config, validate_attention


def _np_proxy(q_HD, k_KTD, v_KTD, valid_KT, bits, k_keep, tail):
  """One slot, loops and float64: quantize k - mu per channel, top k_keep by proxy score, exact
  softmax over them, tail = (logsumexp of the rest's proxy scores, mean V)."""
  num_kv, _, d = k_KTD.shape
  g = q_HD.shape[0] // num_kv
  scale = 1.0 / math.sqrt(d)
  o_HD, lse_H, cnt_H = np.zeros(q_HD.shape), np.full(q_HD.shape[0], -np.inf), np.zeros(
      q_HD.shape[0], int)
  for kv in range(num_kv):
    idx = np.nonzero(valid_KT[kv])[0]
    if idx.size == 0:
      continue
    k, v = k_KTD[kv, idx].astype(np.float64), v_KTD[kv, idx].astype(np.float64)
    mu = k.mean(0)
    kc = k - mu
    lo, hi = kc.min(0), kc.max(0)
    levels = 2 ** bits - 1
    step = np.where(hi > lo, (hi - lo) / levels, 1.0)
    code = np.clip(np.round((kc - lo) / step), 0, levels)
    for h in range(kv * g, (kv + 1) * g):
      q = q_HD[h].astype(np.float64)
      # Scan weights scale * q * step rounded to int8 (query_weights); rank by the integer sum.
      wq, sw = proxy.query_weights(scale * q * step, xp=np)
      raw = sw[0] * (code @ wq)
      sp = raw + (q @ lo + q @ mu) * scale
      kth = np.sort(raw)[::-1][min(k_keep, idx.size) - 1]
      top = np.nonzero(raw >= kth)[0]  # every key tied with the k_keep-th is read too
      kk = top.size
      s = k[top] @ q * scale
      e = np.exp(s - s.max())
      o, lse = e @ v[top] / e.sum(), s.max() + np.log(e.sum())
      rest = np.setdiff1d(np.arange(idx.size), top)
      if tail == "mean" and rest.size:
        lt = np.log(np.sum(np.exp(sp[rest])))
        l = np.logaddexp(lse, lt)
        o = np.exp(lse - l) * o + np.exp(lt - l) * v.mean(0)
        lse = l
      o_HD[h], lse_H[h], cnt_H[h] = o, lse, kk
  return o_HD, lse_H, cnt_H


def _run(q, k, v, valid, bits, k_keep_B, tail):
  index = proxy.build_index(jnp.asarray(k), jnp.asarray(valid), bits)
  vbar = proxy.pool_mean_values(jnp.asarray(v), jnp.asarray(valid))
  k_keep_B = np.asarray(k_keep_B, np.int32)
  return [np.asarray(x) for x in proxy.proxy_attention_ref(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(valid), index, vbar,
      jnp.asarray(k_keep_B), int(max(k_keep_B.max(), 1)), tail=tail)]


def _data(seed, b=2, kv=2, g=3, t=40, d=16):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(b, kv * g, d)).astype(np.float32) * 2
  k = rng.normal(size=(b, kv, t, d)).astype(np.float32) + rng.normal(size=(1, kv, 1, d)) * 0.5
  v = rng.normal(size=(b, kv, t, d)).astype(np.float32)
  return q, k, v


@pytest.mark.parametrize("tail", ["mean", "none"])
@pytest.mark.parametrize("bits", [2, 4])
def test_matches_numpy_reference_and_counts_rows(tail, bits):
  q, k, v = _data(0)
  valid = np.ones(k.shape[:3], bool)
  valid[1, :, 31:] = False  # a ragged second slot
  k_keep_B = [5, 3]
  o, lse, cnt = _run(q, k, v, valid, bits, k_keep_B, tail)
  for b in range(2):
    o_w, lse_w, cnt_w = _np_proxy(q[b], k[b], v[b], valid[b], bits, k_keep_B[b], tail)
    np.testing.assert_allclose(o[b], o_w, atol=2e-5)
    np.testing.assert_allclose(lse[b], lse_w, atol=2e-5)
    # Cost accounting: k_keep rows read per query head, plus the keys whose integer scan score
    # ties the k_keep-th (common at 2 bits on 40 keys); the tail reads none.
    np.testing.assert_array_equal(cnt[b], cnt_w)
    assert (cnt[b] >= k_keep_B[b]).all()


def test_quantization_error_is_at_most_half_a_step():
  _, k, _ = _data(1)
  valid = np.ones(k.shape[:3], bool)
  mu, kq, step = (np.asarray(x) for x in proxy.quantize_keys(jnp.asarray(k),
                                                                   jnp.asarray(valid), 4))
  kc = k - mu[:, :, None]
  assert np.all(np.abs(kq - kc) <= step[:, :, None] / 2 + 1e-5)
  assert np.abs(kq - kc).max() > 0  # 4 bits is lossy on Gaussian keys


def test_reading_the_whole_pool_is_dense_attention():
  q, k, v = _data(2)
  valid = np.ones(k.shape[:3], bool)
  o, lse, cnt = _run(q, k, v, valid, 2, [40, 40], "mean")
  s = np.einsum("bkgd,bktd->bkgt", q.reshape(2, 2, 3, -1).astype(np.float64), k) / 4.0
  w = np.exp(s - s.max(-1, keepdims=True))
  o_d = (np.einsum("bkgt,bktd->bkgd", w, v) / w.sum(-1)[..., None]).reshape(o.shape)
  np.testing.assert_allclose(o, o_d, atol=2e-5)
  assert (cnt == 40).all()


def test_8bit_proxy_selects_the_true_top_keys():
  """With well-separated scores, the proxy top-k is the oracle top-k (the selection works)."""
  q, k, v = _data(3, b=1, kv=1, g=1, t=64, d=8)
  k[0, 0, :5] += 4 * q[0, 0] / np.linalg.norm(q[0, 0])  # five clear winners
  valid = np.ones(k.shape[:3], bool)
  o, _, _ = _run(q, k, v, valid, 8, [5], "none")
  s = k[0, 0] @ q[0, 0]
  top = np.argsort(-s)[:5]
  w = np.exp((s[top] - s[top].max()) / math.sqrt(8))
  np.testing.assert_allclose(o[0, 0], w @ v[0, 0, top] / w.sum(), atol=1e-5)


def test_empty_pool_single_key_and_zero_norm_keys():
  q, k, v = _data(4, b=3, t=6)
  valid = np.zeros(k.shape[:3], bool)
  valid[1, :, 2] = True  # slot 1: a single pool key
  k[2] = 0.0  # slot 2: all keys zero (zero-norm, constant channels)
  valid[2] = True
  o, lse, cnt = _run(q, k, v, valid, 4, [0, 1, 2], "mean")
  assert np.all(np.isfinite(o))
  # Empty pool: nothing read, o = 0, lse = -inf.
  assert (o[0] == 0).all() and np.isneginf(lse[0]).all() and (cnt[0] == 0).all()
  # One key: attention over it is its value, lse its score.
  for h in range(6):
    np.testing.assert_allclose(o[1, h], v[1, h // 3, 2], atol=1e-6)
    np.testing.assert_allclose(lse[1, h], k[1, h // 3, 2] @ q[1, h] / 4.0, atol=1e-5)
  # Zero keys: every score is 0, so the estimate is exactly the mean value (top + tail).
  for h in range(6):
    np.testing.assert_allclose(o[2, h], v[2, h // 3].mean(0), atol=1e-5)
    np.testing.assert_allclose(lse[2, h], math.log(6), atol=1e-5)


def test_keep_count_and_index_bytes():
  got = np.asarray(proxy.keep_count(0.03, jnp.asarray([0, 1, 10, 100, 2936])))
  np.testing.assert_array_equal(got, [0, 1, 1, 3, 89])
  assert proxy.index_bytes_per_token(4, 64) == 32.0


def test_config_default_is_the_paper_and_rejects_unknown_estimators():
  assert AttentionConfig().estimator == "magicpig"
  validate_attention(AttentionConfig(estimator="proxy"))
  for bad, msg in [(dict(estimator="hash"), "estimator"), (dict(proxy_bits=0), "proxy_bits"),
                   (dict(proxy_fraction=0.0), "proxy_fraction"), (dict(proxy_tail="x"), "tail")]:
    with pytest.raises(ValueError, match=msg):
      validate_attention(AttentionConfig(**bad))


def test_ffi_backend_runs_the_proxy_estimator_in_a_proxy_store():
  """estimator="proxy" on the FFI path: the backend's host store runs the proxy (no tables, no
  code columns) with the configured bits, fraction and tail."""
  import jax.numpy as jnp
  from pigjax.magicpig import MagicPigBackend
  cfg = Config(attention=AttentionConfig(kind="magicpig", estimator="proxy", proxy_fraction=0.05,
                                         proxy_tail="none"))
  be = MagicPigBackend(cfg)
  be.create_cache(1, 256, jnp.float32)
  s = be.store
  try:
    assert (s.estimator, s.code_columns, s.proxy_bits, s.proxy_fraction, s.proxy_tail) == (
        "proxy", 0, 4, 0.05, "none")
    assert be.stats(None)["index_bytes_per_token"] == 32.0
  finally:
    s.close()
