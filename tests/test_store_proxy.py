"""The host store's proxy estimator (xla_ffi/proxy.h, store_proxy.h) against its pure-jnp twin
(pigjax/proxy.py): random pools, appended keys, ties, edge cases and bad operands.

Shape letters: B batch, K kv heads, H query heads, T tokens, D head dim.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pigjax.estimators import proxy
from pigjax.store import HostKVStore, store_attend, store_insert

RuntimeErr = jax.errors.JaxRuntimeError


@functools.partial(jax.jit, static_argnames=("bits", "fraction", "tail", "k_max"))
def _ref(q_BHD, k_BKTD, v_BKTD, lengths_B, first_B, *, bits, fraction, tail, k_max):
  """The reference over the first lengths_B tokens, with the index statistics of the first
  first_B tokens (the pool's first insert) applied to all of them, as the store codes appends."""
  B, K, T, _ = k_BKTD.shape
  t_BKT = jnp.broadcast_to(jnp.arange(T)[None, None], (B, K, T))
  valid_BKT = t_BKT < lengths_B[:, None, None]
  mu, lo, step = proxy.quantize_stats(k_BKTD, t_BKT < first_B[:, None, None], bits)
  index = proxy.ProxyIndex(mu, lo, step, proxy.quantize_codes(k_BKTD, valid_BKT, mu, lo,
                                                                         step, bits))
  vbar = proxy.pool_mean_values(v_BKTD, valid_BKT)
  k_keep_B = proxy.keep_count(fraction, lengths_B)
  return proxy.proxy_attention_ref(q_BHD, k_BKTD, v_BKTD, valid_BKT, index, vbar, k_keep_B,
                                        k_max, tail=tail), mu


def _data(seed, B, K, G, T, D, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  offset = rng.normal(size=(1, K, 1, D)) * 1.5  # a common key offset, so centring matters
  k = jnp.asarray(rng.normal(size=(B, K, T, D)) + offset, dtype)
  v = jnp.asarray(rng.normal(size=(B, K, T, D)), dtype)
  q = jnp.asarray(rng.normal(size=(B, K * G, D)) * 2.0, dtype)
  return k, v, q


def _store(B, K, D, capacity, *, dtype="float32", bits=4, fraction=0.1, tail="mean", threads=0):
  return HostKVStore(num_layers=1, num_slots=B, num_kv_heads=K, head_dim=D, num_bits=10,
                     num_tables=150, capacity=capacity, dtype=dtype, threads=threads,
                     estimator="proxy", proxy_bits=bits, proxy_fraction=fraction,
                     proxy_tail=tail, verbose=False)


def _no_codes(x):
  return jnp.zeros(x.shape[:-1] + (0,), jnp.int32)


def _insert(store, k, v, lengths, mu, slots=None):
  B = k.shape[0]
  slots = jnp.arange(B, dtype=jnp.int32) if slots is None else slots
  return store_insert(store.handle, 0, slots, k, v, _no_codes(k), jnp.asarray(lengths, jnp.int32),
                      mu)


def _attend(store, q, dep):
  B = q.shape[0]
  return jax.block_until_ready(store_attend(store.handle, 0, jnp.arange(B, dtype=jnp.int32), q,
                                            _no_codes(q), dep))


def _check(got, want, atol):
  (o, lse, count), (o_r, lse_r, count_r) = got, want
  np.testing.assert_array_equal(np.asarray(count), np.asarray(count_r))
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_r), atol=atol, rtol=atol)
  np.testing.assert_allclose(np.asarray(o), np.asarray(o_r), atol=atol)


@pytest.mark.parametrize("kernels", ["avx2", "scalar"])
@pytest.mark.parametrize(
    "B,K,G,D,bits,fraction,tail,lengths",
    [
        (2, 2, 3, 64, 4, 0.1, "mean", [300, 57]),
        (1, 1, 1, 64, 4, 0.03, "mean", [5000]),  # the sampled-threshold selection path
        (1, 1, 3, 64, 4, 0.03, "mean", [1100]),  # ... from kSampleMinScores = 1024 scores on
        (2, 1, 3, 64, 4, 0.03, "mean", [5000, 1500]),  # ... with pools of different lengths
        (1, 1, 2, 64, 4, 0.05, "mean", [32768]),  # LargestAt's bins (sample and kept >= 1024)
        (3, 1, 9, 40, 3, 0.2, "none", [0, 1, 129]),  # padded channels, an empty and a 1-key pool
        (1, 2, 2, 24, 6, 0.05, "mean", [700]),  # byte-per-channel index
    ])
def test_kernel_matches_reference(monkeypatch, kernels, B, K, G, D, bits, fraction, tail,
                                  lengths):
  if kernels == "scalar":
    monkeypatch.setenv("PIGJAX_KERNELS", "scalar")
  T = max(max(lengths), 1)
  k, v, q = _data(0, B, K, G, T, D)
  lengths_B = jnp.asarray(lengths, jnp.int32)
  k_max = max(1, int(np.ceil(fraction * T)))
  want, mu = _ref(q, k, v, lengths_B, lengths_B, bits=bits, fraction=fraction, tail=tail,
                  k_max=k_max)
  with _store(B, K, D, T, bits=bits, fraction=fraction, tail=tail) as store:
    if kernels == "scalar":
      assert store.isa == "scalar"
    got = _attend(store, q, _insert(store, k, v, lengths_B, mu))
  _check(got, want, 2e-5)
  # Rows read: ceil(fraction * n), plus the keys whose integer scan score ties the k-th (none in
  # pools of a few thousand random keys, a few at 32k); _check has compared them with the
  # reference's.
  for b, n in enumerate(lengths):
    k_keep = 0 if n == 0 else max(1, int(np.ceil(fraction * n)))
    assert np.all(np.asarray(got[2])[b] >= k_keep) and np.all(np.asarray(got[2])[b] <= k_keep + 8)
  assert np.all(np.isneginf(np.asarray(got[1])[np.asarray(lengths) == 0]))


def test_appended_keys_use_the_first_inserts_statistics():
  """Generated keys moved into the pool later are coded with the first insert's mu, lo and step,
  clamped (some appended keys lie far outside the first keys' range)."""
  B, K, G, D, first, more = 2, 2, 2, 64, 200, 48
  k, v, q = _data(1, B, K, G, first + more, D)
  k = k.at[:, :, first:].multiply(3.0)
  first_B = jnp.asarray([first, 120], jnp.int32)
  more_B = jnp.asarray([more, 30], jnp.int32)
  want, mu = _ref(q, k, v, first_B + more_B, first_B, bits=4, fraction=0.1, tail="mean",
                  k_max=25)
  with _store(B, K, D, first + more) as store:
    n1 = _insert(store, k, v, first_B, mu)
    # The appended rows: each slot's tokens [first_B[b], first_B[b] + more_B[b]).
    idx = first_B[:, None] + jnp.arange(more)[None]
    take = lambda x: jnp.take_along_axis(x, jnp.minimum(idx, first + more - 1)[:, None, :, None],
                                         axis=2)
    n2 = _insert(store, take(k), take(v), more_B, jnp.zeros_like(mu) + n1[0] * 0)
    got = _attend(store, q, n2)
    assert [store.num_tokens(0, b) for b in range(B)] == list(np.asarray(first_B + more_B))
  _check(got, want, 2e-5)


def test_ties_with_the_kth_score_are_all_read():
  """Duplicated keys have equal proxy scores: every key tied with the k_keep-th is read (as in
  the reference), so the count exceeds k_keep."""
  B, K, G, D, T = 1, 1, 2, 32, 60
  k, v, q = _data(2, B, K, G, T, D)
  k = jnp.concatenate([jnp.repeat(k[:, :, :6], 10, axis=2)], axis=2)  # 6 keys, 10 copies each
  lengths_B = jnp.asarray([T], jnp.int32)
  want, mu = _ref(q, k, v, lengths_B, lengths_B, bits=4, fraction=0.05, tail="mean", k_max=3)
  with _store(B, K, D, T, fraction=0.05) as store:
    got = _attend(store, q, _insert(store, k, v, lengths_B, mu))
  assert np.all(np.asarray(got[2]) == 10)  # k_keep = 3, the top key's 10 copies are read
  _check(got, want, 2e-5)


def test_identical_keys_single_key_and_zero_norm_key():
  """A pool of copies of one key (every channel constant: step 1, code 0; the centred key is 0)
  is read whole: o = mean V, lse = q.k / sqrt(D) + log n. A single key: o = v, count 1."""
  D, n = 16, 7
  rng = np.random.default_rng(3)
  k1 = rng.normal(size=(1, 1, 1, D)).astype(np.float32)
  k = jnp.asarray(np.repeat(k1, n, axis=2))
  v = jnp.asarray(rng.normal(size=(1, 1, n, D)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(1, 2, D)), jnp.float32)
  mu = jnp.asarray(k1[:, :, 0])
  s = np.asarray(q)[0] @ k1[0, 0, 0] / np.sqrt(D)
  with _store(1, 1, D, n) as store:
    o, lse, count = _attend(store, q, _insert(store, k, v, [n], mu))
  np.testing.assert_array_equal(np.asarray(count), [[n, n]])
  np.testing.assert_allclose(np.asarray(lse)[0], s + np.log(n), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(o)[0], np.repeat(np.asarray(v)[0, 0].mean(0)[None], 2, 0),
                             atol=1e-5)
  with _store(1, 1, D, n) as store:
    o, lse, count = _attend(store, q, _insert(store, k, v, [1], mu))
  np.testing.assert_array_equal(np.asarray(count), [[1, 1]])
  np.testing.assert_allclose(np.asarray(o)[0], np.repeat(np.asarray(v)[0, 0, :1], 2, 0),
                             atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse)[0], s, rtol=1e-5)


def test_bfloat16_store_and_queries():
  B, K, G, D, T = 2, 1, 3, 64, 400
  k, v, q = _data(4, B, K, G, T, D, jnp.bfloat16)
  lengths_B = jnp.asarray([T, 250], jnp.int32)
  want, mu = _ref(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), lengths_B,
                  lengths_B, bits=4, fraction=0.05, tail="mean", k_max=20)
  with _store(B, K, D, T, dtype="bfloat16", fraction=0.05) as store:
    got = _attend(store, q, _insert(store, k, v, lengths_B, mu))
  _check(got, want, 2e-5)  # bfloat16 inputs are exact in the float32 reference


def test_threads_do_not_change_the_result():
  """Long pools split the scan and the exact part over the store's workers; one worker or four,
  the answer is bitwise the same (pieces merge in a fixed order)."""
  B, K, G, D, T = 2, 1, 3, 64, 9000
  k, v, q = _data(5, B, K, G, T, D)
  lengths_B = jnp.asarray([T, 7000], jnp.int32)
  mu = proxy.pool_mean_values(k, jnp.arange(T)[None, None] < lengths_B[:, None, None])
  outs = []
  for threads in (1, 4):
    with _store(B, K, D, T, threads=threads) as store:
      outs.append([np.asarray(x) for x in _attend(store, q, _insert(store, k, v, lengths_B, mu))])
  for a, b in zip(*outs):
    np.testing.assert_array_equal(a, b)


def test_bad_operands_and_settings_give_clear_errors():
  D = 16
  k, v, q = _data(6, 1, 1, 1, 10, D)
  mu = jnp.zeros((1, 1, D), jnp.float32)
  with _store(1, 1, D, 10) as store:
    codes = jnp.zeros((1, 1, 10, 150), jnp.int32)  # LSH codes handed to a proxy store
    with pytest.raises(ValueError, match="none for a proxy store"):
      store_insert(store.handle, 0, jnp.zeros((1,), jnp.int32), k, v, codes,
                   jnp.asarray([10], jnp.int32), mu)
    with pytest.raises(ValueError, match="none for a proxy store"):
      store_attend(store.handle, 0, jnp.zeros((1,), jnp.int32), q, jnp.zeros((1, 1, 150),
                                                                            jnp.int32), 0)
    # The same, unchecked in Python (traced handle): the C++ store names the problem.
    call = jax.jit(lambda h: store_attend(h, 0, jnp.zeros((1,), jnp.int32), q,
                                          jnp.zeros((1, 1, 150), jnp.int32), 0))
    with pytest.raises(RuntimeErr, match="proxy estimator's store takes no codes"):
      jax.block_until_ready(call(jnp.int32(store.handle)))
  for kw, msg in [(dict(bits=9), "proxy_bits"), (dict(bits=0), "proxy_bits"),
                  (dict(fraction=0.0), "proxy_fraction"), (dict(tail="sample"), "proxy_tail")]:
    with pytest.raises(ValueError, match=msg):
      _store(1, 1, D, 10, **kw)
  with pytest.raises(ValueError, match="estimator"):
    HostKVStore(num_layers=1, num_slots=1, num_kv_heads=1, head_dim=D, num_bits=4, num_tables=8,
                capacity=8, estimator="hash", verbose=False)


def test_index_memory_is_accounted():
  """The proxy store's worst case holds K/V rows and the index, no tables: far below the LSH
  store's at (10, 150); the index is 32 bytes per token and kv head at 4 bits, D = 64."""
  geo = dict(num_layers=2, num_slots=1, num_kv_heads=3, head_dim=64, num_bits=10, num_tables=150,
             capacity=4096, threads=1)
  lsh_bytes = HostKVStore.estimate_bytes(**geo)
  proxy_bytes = HostKVStore.estimate_bytes(**geo, estimator="proxy")
  proxy8 = HostKVStore.estimate_bytes(**geo, estimator="proxy", proxy_bits=8)
  proxy3 = HostKVStore.estimate_bytes(**geo, estimator="proxy", proxy_bits=3)
  assert proxy_bytes < lsh_bytes / 2
  extra8 = proxy.index_bytes_per_token(8, 64) - proxy.index_bytes_per_token(4, 64)
  assert proxy8 - proxy_bytes == 2 * 3 * 4096 * extra8
  assert (proxy.index_bytes_per_token(4, 64), proxy.index_bytes_per_token(8, 64)) == (32, 64)
  assert proxy3 == proxy_bytes  # 3 bits are stored (and scanned) as 4
  assert (proxy.index_bytes_per_token(4, 40), proxy.index_bytes_per_token(6, 24)) == (24, 24)  # padded groups


@pytest.mark.parametrize("T", [1600, 4096, 20000])  # 20000: the fallback through the bins
def test_selection_when_the_sampled_threshold_keeps_too_few(T):
  """Pools of 1024 scores or more pick the k-th score through a threshold from every 16th score;
  when exactly those keys are the heaviest the threshold keeps fewer than k, and the selection
  must fall back to the whole pool (and still match the reference)."""
  B, K, G, D = 1, 1, 2, 32
  rng = np.random.default_rng(7)
  q = jnp.asarray(rng.normal(size=(B, K * G, D)), jnp.float32)
  heavy = (np.arange(T) % 16 == 0)[None, None, :, None]
  k = rng.normal(size=(B, K, T, D)) * 0.3 + heavy * np.asarray(q)[:, :1, None, :] * 2.0
  k, v = jnp.asarray(k, jnp.float32), jnp.asarray(rng.normal(size=(B, K, T, D)), jnp.float32)
  lengths_B = jnp.asarray([T], jnp.int32)
  k_keep = int(np.ceil(0.03 * T))
  want, mu = _ref(q, k, v, lengths_B, lengths_B, bits=4, fraction=0.03, tail="mean",
                  k_max=k_keep)
  with _store(B, K, D, T, fraction=0.03) as store:
    got = _attend(store, q, _insert(store, k, v, lengths_B, mu))
  # k_keep rows, plus any key whose integer scan score ties the k_keep-th (a few at most, more in
  # the larger pool): the count must equal the reference's (_check).
  assert np.all(np.asarray(got[2]) >= k_keep) and np.all(np.asarray(got[2]) <= k_keep + 8)
  _check(got, want, 2e-5)
