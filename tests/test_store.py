"""The host KV store and its FFI kernels against the pure-jnp oracle (pigjax/lsh.py).

Shape letters: B batch, K kv heads, H query heads, T tokens, D head dim, L tables.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pigjax import lsh, reference
from pigjax.store import HostKVStore, store_attend, store_insert

D = 64
RuntimeErr = jax.errors.JaxRuntimeError


@functools.partial(jax.jit, static_argnums=(4, 5))
def _hash_and_ref(k_BKTD, v_BKTD, q_BHD, lengths_B, num_bits, num_tables):
  """Codes, mean and the oracle's answer, all in one compiled program (keeps the tests fast)."""
  B, K, T, _ = k_BKTD.shape
  valid_BKT = jnp.broadcast_to(jnp.arange(T)[None, None] < lengths_B[:, None, None], (B, K, T))
  w = lsh.simhash_matrix(0, 3, D, num_bits, num_tables)
  mu, codes = lsh.centre_and_hash(k_BKTD, valid_BKT, w, num_bits, num_tables)
  qcodes = lsh.hash_codes(q_BHD, w, num_bits, num_tables)
  ref = reference.pool_attention_ref(q_BHD, k_BKTD, v_BKTD, valid_BKT, mu, w, num_bits, num_tables,
                               codes_BKTL=codes)
  return dict(mu=mu, codes=codes, qcodes=qcodes, ref=ref)


def _make(seed, B, K, G, T, lengths, num_bits, num_tables, dtype=jnp.float32, q_dtype=None,
          oracle=True):
  """Random keys with a common offset (so centring matters), values, queries; codes; oracle.

  oracle=False: random codes and a numpy mean instead of hashing, and no oracle (nothing to
  compile), for the tests of bookkeeping and errors.
  """
  rng = np.random.default_rng(seed)
  offset = rng.normal(size=(1, K, 1, D)) * 1.5
  k = jnp.asarray(rng.normal(size=(B, K, T, D)) + offset, dtype)
  v = jnp.asarray(rng.normal(size=(B, K, T, D)), dtype)
  q = jnp.asarray(rng.normal(size=(B, K * G, D)) * 2.0, q_dtype or dtype)
  lengths_B = jnp.asarray(lengths, jnp.int32)
  if oracle:
    return dict(k=k, v=v, q=q, lengths=lengths_B,
                **_hash_and_ref(k, v, q, lengths_B, num_bits, num_tables))
  codes = rng.integers(0, 2**num_bits, size=(B, K, T, num_tables), dtype=np.int32)
  qcodes = rng.integers(0, 2**num_bits, size=(B, K * G, num_tables), dtype=np.int32)
  mu = np.mean(np.asarray(k, np.float32), axis=2)
  return dict(k=k, v=v, q=q, lengths=lengths_B, mu=jnp.asarray(mu), codes=jnp.asarray(codes),
              qcodes=jnp.asarray(qcodes))


def _store(num_slots, K, num_bits, num_tables, capacity, dtype="float32", **kw):
  return HostKVStore(num_layers=2, num_slots=num_slots, num_kv_heads=K, head_dim=D,
                     num_bits=num_bits, num_tables=num_tables, capacity=capacity, dtype=dtype,
                     verbose=False, **kw)


def _insert_attend(store, d, slots, layer=1):
  n = store_insert(store.handle, layer, slots, d["k"], d["v"], d["codes"], d["lengths"], d["mu"])
  # Wait for the results: callers read them after the store's `with` block, and jax dispatches
  # asynchronously, so on a busy machine the calls could otherwise run after the store closed.
  return jax.block_until_ready((n, store_attend(store.handle, layer, slots, d["q"], d["qcodes"],
                                                n)))


# ------------------------------------------------------------------------------------------------
# Agreement with the oracle


@pytest.mark.parametrize(
    "store_dtype,B,G,num_bits,num_tables,lengths",
    [
        ("float32", 1, 1, 4, 8, [300]),
        ("float32", 3, 3, 4, 8, [0, 1, 357]),
        ("float32", 3, 1, 6, 20, [2900, 5, 640]),
        ("float32", 1, 3, 10, 150, [3000]),
        ("bfloat16", 1, 3, 4, 8, [300]),
        ("bfloat16", 3, 3, 8, 75, [2500, 0, 1]),
        ("bfloat16", 3, 1, 5, 12, [123, 456, 78]),
    ])
def test_attend_matches_reference(store_dtype, B, G, num_bits, num_tables, lengths):
  K, T = 2, max(max(lengths), 1)
  # K/V/q already in the store dtype, so the store holds exactly what the oracle sees: the only
  # differences are f32 summation order and (q.k - q.mu) vs q.(k - mu) in the cosine.
  d = _make(B + G + num_bits, B, K, G, T, lengths, num_bits, num_tables, jnp.dtype(store_dtype))
  slots = jnp.asarray([4, 0, 2][:B], jnp.int32)  # not the identity: rows map onto store slots
  with _store(5, K, num_bits, num_tables, 3000, store_dtype) as s:
    n, (o, lse, count) = _insert_attend(s, d, slots)
    ro, rlse, rcount = d["ref"]
    np.testing.assert_array_equal(n, lengths)
    for b in range(B):
      assert s.num_tokens(1, int(slots[b])) == lengths[b]
      assert s.num_tokens(0, int(slots[b])) == 0
    np.testing.assert_array_equal(count, rcount)
    assert o.dtype == jnp.float32 and lse.dtype == jnp.float32 and count.dtype == jnp.int32
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rlse))
    np.testing.assert_allclose(lse, rlse, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(o, ro, rtol=1e-4, atol=1e-4)
    if 0 in lengths:
      b = lengths.index(0)
      assert np.all(np.isneginf(lse[b])) and np.all(o[b] == 0) and np.all(count[b] == 0)
    if num_bits == 4:  # (4, 8): ~8% of the pool per query head (vs ~2% for (10, 150))
      frac = lsh.expected_candidate_fraction(num_bits, num_tables)
      assert np.sum(count) > 0.5 * frac * G * K * sum(lengths)


def test_bf16_storage_of_f32_inputs():
  """f32 K/V rounded to bf16 in the store vs the f32 oracle.

  Same candidates (codes come from the f32 keys). bf16 keeps 8 mantissa bits (relative error
  <= 2^-9 per element): with |q| ~ 16, |k| ~ 15 and D = 64 the logit error q.k/8 is ~ 0.01 and the
  cosine error a few 1e-3, so lse and o agree to a few 1e-2, not to float precision.
  """
  num_bits, num_tables = 6, 20
  d = _make(7, 2, 2, 3, 800, [800, 450], num_bits, num_tables)
  with _store(2, 2, num_bits, num_tables, 1000, "bfloat16") as s:
    _, (o, lse, count) = _insert_attend(s, d, jnp.arange(2))
  ro, rlse, rcount = d["ref"]
  np.testing.assert_array_equal(count, rcount)
  np.testing.assert_allclose(lse, rlse, atol=5e-2)
  np.testing.assert_allclose(o, ro, atol=5e-2)


@functools.partial(jax.jit, static_argnums=(5, 6, 7))
def _stored_ref(k_BKTD, v_BKTD, q_BHD, lengths_B, codes_BKTL, num_bits, num_tables, store_dtype):
  """The oracle over what a store of `store_dtype` holds (reference.stored_values), with the codes and
  mean of the unrounded keys, as the engine hashes them before the insert."""
  B, K, T, _ = k_BKTD.shape
  valid_BKT = jnp.broadcast_to(jnp.arange(T)[None, None] < lengths_B[:, None, None], (B, K, T))
  w = lsh.simhash_matrix(0, 3, D, num_bits, num_tables)
  mu, _ = lsh.centre_and_hash(k_BKTD, valid_BKT, w, num_bits, num_tables)
  return reference.pool_attention_ref(q_BHD, reference.stored_values(k_BKTD, store_dtype),
                                reference.stored_values(v_BKTD, store_dtype), valid_BKT, mu, w,
                                num_bits, num_tables, codes_BKTL=codes_BKTL)


@pytest.mark.parametrize("kernels", ["best", "scalar"])
def test_int8_store_matches_reference(kernels, monkeypatch):
  """int8 K/V with a per-row scale (store dtype "int8") against the oracle over the same
  quantised rows (reference.quantize_int8_rows): equal up to f32 summation order, as for float32. And
  against the unquantised f32 oracle: int8 rounds each element by at most max|row| / 254, a
  little more than bf16's 2^-9 relative, so the same loose bound as the bf16 test holds."""
  monkeypatch.setenv("PIGJAX_KERNELS", kernels)
  num_bits, num_tables, B, K, G = 6, 20, 2, 2, 3
  lengths = [800, 450]
  d = _make(41, B, K, G, 800, lengths, num_bits, num_tables)
  with _store(B, K, num_bits, num_tables, 1000, "int8") as s:
    assert (s.isa == "scalar") == (kernels == "scalar")
    o, lse, count = jax.block_until_ready(_insert_attend(s, d, jnp.arange(B))[1])
  ro, rlse, rcount = _stored_ref(d["k"], d["v"], d["q"], d["lengths"], d["codes"], num_bits,
                                 num_tables, "int8")
  np.testing.assert_array_equal(count, rcount)
  np.testing.assert_allclose(lse, rlse, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(o, ro, rtol=1e-4, atol=1e-4)
  fo, flse, _ = d["ref"]
  assert np.max(np.abs(np.asarray(o) - np.asarray(fo))) > 0  # it is quantised
  np.testing.assert_allclose(lse, flse, atol=5e-2)
  np.testing.assert_allclose(o, fo, atol=5e-2)


def test_quantize_int8_rows():
  """Scale max|x| / 127 per row, ties to even, the largest element exactly +-127, zero rows."""
  x = jnp.asarray([[127.0, 63.5, 62.5, -0.5], [0.0, 0.0, 0.0, 0.0], [-254.0, 1.0, 3.0, 0.0]],
                  jnp.float32)  # scales 1, 1 (zero row) and 2: every division exact
  x8, scale = reference.quantize_int8_rows(x)
  np.testing.assert_array_equal(scale, [1.0, 1.0, 2.0])
  np.testing.assert_array_equal(x8, [[127, 64, 62, 0], [0, 0, 0, 0], [-127, 0, 2, 0]])
  assert x8.dtype == jnp.int8
  with pytest.raises(ValueError, match="store_dtype"):
    reference.stored_values(x, "int4")


def test_bf16_queries_and_scalar_kernels_and_threads(monkeypatch):
  """bf16 q; the portable scalar kernels and a 1-thread pool agree with AVX2 and 2 threads."""
  num_bits, num_tables = 5, 16
  d = _make(11, 2, 2, 3, 500, [500, 333], num_bits, num_tables, q_dtype=jnp.bfloat16)
  outs = []
  for kernels, threads in [("auto", 2), ("scalar", 1)]:
    monkeypatch.setenv("PIGJAX_KERNELS", kernels)
    with _store(2, 2, num_bits, num_tables, 500, threads=threads) as s:
      assert s.threads == threads
      assert (s.isa == "scalar") == (kernels == "scalar")
      outs.append(_insert_attend(s, d, jnp.arange(2))[1])
  ro, rlse, _ = d["ref"]
  for o, lse, _ in outs:
    np.testing.assert_allclose(lse, rlse, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(o, ro, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(outs[0][2], outs[1][2])


@pytest.mark.parametrize("num_bits,num_tables", [(3, 8), (8, 40)])
def test_two_phase_attend_matches_reference_and_one_thread(num_bits, num_tables, monkeypatch):
  """Pools large enough (pool x query heads >= 32768) for the two-phase parallel attend, whose
  heads' candidates are split into pieces of 512 and merged by log-sum-exp: equal to the oracle
  and to the one-worker path. (3, 8) gives thousands of candidates per head (many pieces); an
  empty pool row and a tiny one ride along."""
  lengths = [6000, 0, 3]
  d = _make(21 + num_bits, 3, 2, 4, 6000, lengths, num_bits, num_tables)
  outs = []
  for threads in (2, 1):
    with _store(3, 2, num_bits, num_tables, 6000, threads=threads) as s:
      outs.append(jax.block_until_ready(_insert_attend(s, d, jnp.arange(3))[1]))
  ro, rlse, rcount = d["ref"]
  if num_bits == 3:
    assert np.min(np.asarray(rcount)[0]) > 2 * 512  # several pieces per head
  for o, lse, count in outs:
    np.testing.assert_array_equal(count, rcount)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rlse))
    np.testing.assert_allclose(lse, rlse, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(o, ro, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernels", ["best", "scalar"])
def test_row_output_independent_of_batch_mates(kernels, monkeypatch):
  """A row's attend output is bitwise the same alone and beside rows of very different pool
  lengths. Alone the call is below the parallel threshold (pool x query heads < 32768) and runs
  on the calling thread; in the batch it is above and runs on two workers: each head must still
  be summed in the same pieces and merge order, or greedy decoding diverges in a batch."""
  monkeypatch.setenv("PIGJAX_KERNELS", kernels)
  num_bits, num_tables, K, G = 2, 8, 2, 3  # random codes: ~60% of the pool collides, 3 pieces
  lengths = [2000, 6000, 7, 0]
  d = _make(31, 4, K, G, 6000, lengths, num_bits, num_tables, oracle=False)
  with _store(4, K, num_bits, num_tables, 6000, threads=2) as s:
    assert (s.isa == "scalar") == (kernels == "scalar")
    n = store_insert(s.handle, 1, jnp.arange(4, dtype=jnp.int32), d["k"], d["v"], d["codes"],
                     d["lengths"], d["mu"])

    def attend(rows):
      rows = jnp.asarray(rows, jnp.int32)
      return jax.block_until_ready(store_attend(s.handle, 1, rows, d["q"][rows],
                                                d["qcodes"][rows], n[rows]))

    alone = attend([0])
    assert np.min(np.asarray(alone[2])) > 2 * 512  # several pieces per head
    for rows in ([1, 0, 2], [3, 2, 0, 1]):
      batch = attend(rows)
      b = rows.index(0)
      for x, y in zip(alone, batch):
        np.testing.assert_array_equal(np.asarray(x)[0], np.asarray(y)[b])


def test_empty_candidate_set():
  """Pool tokens exist but none collides twice: o = 0, lse = -inf, count = 0; and all collide."""
  B, K, T, L = 1, 2, 50, 8
  d = _make(3, B, K, 1, T, [T], 4, L, oracle=False)
  codes = jnp.zeros((B, K, T, L), jnp.int32)
  qcodes = jnp.ones((B, K, L), jnp.int32).at[:, :, 0].set(0)  # one table matches: not enough
  with _store(1, K, 4, L, T) as s:
    n = store_insert(s.handle, 0, jnp.zeros(1, jnp.int32), d["k"], d["v"], codes, d["lengths"],
                     d["mu"])
    o, lse, count = store_attend(s.handle, 0, jnp.zeros(1, jnp.int32), d["q"], qcodes, n)
    assert np.all(np.isneginf(lse)) and np.all(np.asarray(o) == 0) and np.all(count == 0)
    o, lse, count = store_attend(s.handle, 0, jnp.zeros(1, jnp.int32), d["q"],
                                 qcodes.at[:, :, 1].set(0), n)
    np.testing.assert_array_equal(count, T)
    assert np.all(np.isfinite(lse)) and np.all(np.isfinite(o))


@pytest.mark.parametrize("num_tables", [256, 300, 600])
def test_collision_counts_past_255_tables(num_tables):
  """The lookup counts each token's colliding tables in a byte, in passes of up to 253 tables:
  a token in every table (256 = 0 mod 256), one in the first and last table only (two passes
  apart), and one in a single table."""
  B, K, T, L = 1, 1, 40, num_tables
  d = _make(4, B, K, 1, T, [T], 2, L, oracle=False)
  codes = np.ones((B, K, T, L), np.int32)
  codes[..., :10, :] = 0           # tokens 0-9 collide in every table
  codes[..., 10:20, [0, L - 1]] = 0  # 10-19 in the first and the last
  codes[..., 20:30, 5] = 0         # 20-29 in one table only: not candidates
  qcodes = jnp.zeros((B, K, L), jnp.int32)
  with _store(1, K, 2, L, T) as s:
    n = store_insert(s.handle, 0, jnp.zeros(1, jnp.int32), d["k"], d["v"], jnp.asarray(codes),
                     d["lengths"], d["mu"])
    _, _, count = store_attend(s.handle, 0, jnp.zeros(1, jnp.int32), d["q"], qcodes, n)
  np.testing.assert_array_equal(count, [[20]])


@pytest.mark.parametrize("kernels", ["best", "scalar"])
@pytest.mark.parametrize("num_bits,num_tables", [(1, 2), (4, 8), (10, 150), (16, 1000)])
def test_kernel_log_collision_prob(num_bits, num_tables, kernels, monkeypatch):
  """The kernel's interpolated log u (AVX2 polynomials, or libm in the scalar fallback) against
  the oracle's closed form/series (f32 both)."""
  from pigjax import _pigjax_ffi
  monkeypatch.setenv("PIGJAX_KERNELS", kernels)
  cos = np.concatenate([np.linspace(-1, 1, 20001), 1 - np.logspace(-7, 0, 200),
                        -1 + np.logspace(-7, 0, 200)]).astype(np.float32)
  got = np.asarray(_pigjax_ffi.log_collision_prob(cos.tolist(), num_bits, num_tables))
  want = np.maximum(np.asarray(lsh.log_collision_probability(cos, num_bits, num_tables)),
                    lsh.LOG_U_FLOOR)
  # Near cos = -1, p ~ sqrt(2 (1 + cos)) / pi inherits the f32 rounding of 1 + cos, and two f32
  # arccos implementations (glibc's and XLA's) differ by more there: compare loosely.
  ok = cos > -0.999
  np.testing.assert_allclose(got[ok], want[ok], rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(got[~ok], want[~ok], rtol=1e-3)


# ------------------------------------------------------------------------------------------------
# Store state


def test_append_twice_equals_insert_once():
  num_bits, num_tables, K, T = 4, 10, 2, 400
  d = _make(5, 1, K, 3, T, [T], num_bits, num_tables, oracle=False)
  with _store(2, K, num_bits, num_tables, T) as s:
    h, zero, one = s.handle, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32)
    store_insert(h, 0, zero, d["k"], d["v"], d["codes"], d["lengths"], d["mu"])
    cut = 137
    for lo, hi in [(0, cut), (cut, T)]:
      n = store_insert(h, 0, one, d["k"][:, :, lo:hi], d["v"][:, :, lo:hi],
                       d["codes"][:, :, lo:hi], jnp.asarray([hi - lo]), d["mu"])
    np.testing.assert_array_equal(n, [T])
    a = store_attend(h, 0, zero, d["q"], d["qcodes"], n)
    b = store_attend(h, 0, one, d["q"], d["qcodes"], n)
    for x, y in zip(a, b):  # same ids in the same bucket order: bitwise equal
      np.testing.assert_array_equal(x, y)
    hits = np.sum(np.asarray(d["codes"])[0][:, None] == np.asarray(d["qcodes"])[0].reshape(
        K, 3, 1, num_tables), axis=-1)  # [K, G, T]
    np.testing.assert_array_equal(b[2][0], np.sum(hits >= 2, axis=-1).reshape(-1))
    # A row with length 0 appends nothing; rows only use their first lengths[b] tokens.
    n = store_insert(h, 0, one, d["k"], d["v"], d["codes"], jnp.zeros(1, jnp.int32), d["mu"])
    np.testing.assert_array_equal(n, [T])


def test_pool_across_table_segments():
  """Tables hold 16-bit ids in segments of 2^16 tokens: a pool of two full segments and part of
  a third, inserted in pieces that cross the segment boundaries, matches the oracle and is
  bitwise the pool inserted at once."""
  num_bits, num_tables, K, G = 6, 8, 1, 3
  T = 2 * 65536 + 500
  d = _make(17, 1, K, G, T, [T], num_bits, num_tables)
  zero, one = jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32)
  with _store(2, K, num_bits, num_tables, T, threads=2) as s:
    h = s.handle
    store_insert(h, 0, zero, d["k"], d["v"], d["codes"], d["lengths"], d["mu"])
    for lo, hi in [(0, 65000), (65000, 65536 + 7), (65536 + 7, 2 * 65536 + 1), (2 * 65536 + 1, T)]:
      n = store_insert(h, 0, one, d["k"][:, :, lo:hi], d["v"][:, :, lo:hi],
                       d["codes"][:, :, lo:hi], jnp.asarray([hi - lo]), d["mu"])
    np.testing.assert_array_equal(n, [T])
    once = jax.block_until_ready(store_attend(h, 0, zero, d["q"], d["qcodes"], n))
    pieces = jax.block_until_ready(store_attend(h, 0, one, d["q"], d["qcodes"], n))
  for x, y in zip(once, pieces):
    np.testing.assert_array_equal(x, y)
  o, lse, count = once
  ro, rlse, rcount = d["ref"]
  np.testing.assert_array_equal(count, rcount)
  assert np.min(np.asarray(count)) > 500  # (~0.7% of the pool per head: not vacuous)
  np.testing.assert_allclose(lse, rlse, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(o, ro, rtol=1e-4, atol=1e-4)


def test_profile_bins_every_candidate_by_its_pool_slice():
  """With every code equal to the query's, all n pool tokens are candidates, so the profile's 16
  bins must hold exactly the ids in [ceil(b n / 16), ceil((b + 1) n / 16)) each, for an n that 16
  does not divide."""
  from tools import bench
  num_bits, num_tables, K, G, T = 4, 6, 1, 2, 1003
  d = _make(21, 1, K, G, T, [T], num_bits, num_tables, oracle=False)
  codes = jnp.full_like(d["codes"], 5)
  qcodes = jnp.full_like(d["qcodes"], 5)
  with _store(1, K, num_bits, num_tables, T) as s:
    zero = jnp.zeros(1, jnp.int32)
    n = store_insert(s.handle, 0, zero, d["k"], d["v"], codes, d["lengths"], d["mu"])
    bench.set_profiling(s, True)
    _, _, count = jax.block_until_ready(store_attend(s.handle, 0, zero, d["q"], qcodes, n))
    prof = bench.kernel_profile(s)
  np.testing.assert_array_equal(count, [[T] * G])
  lower = [-(-b * T // 16) for b in range(17)]
  want = [G * (lower[b + 1] - lower[b]) for b in range(16)]
  assert list(prof["candidate_bins"]) == want and sum(want) == G * T


def test_profile_counts_distinct_candidates_per_kv_head():
  """The profile's distinct_candidates is the size of the union of the candidate sets of the
  query heads that share a kv head (computed here from the codes), summed over kv heads."""
  from tools import bench
  num_bits, num_tables, K, G, T = 3, 8, 2, 3, 500
  d = _make(22, 1, K, G, T, [T], num_bits, num_tables, oracle=False)
  with _store(1, K, num_bits, num_tables, T) as s:
    if "distinct_candidates" not in bench.kernel_profile(s):
      pytest.skip("distinct_candidates is compiled in only with -C cmake.define.PIGJAX_PROFILE=ON "
                  "(scripts/sanitize.sh builds it so and runs this test)")
    zero = jnp.zeros(1, jnp.int32)
    n = store_insert(s.handle, 0, zero, d["k"], d["v"], d["codes"], d["lengths"], d["mu"])
    bench.set_profiling(s, True)
    _, _, count = jax.block_until_ready(store_attend(s.handle, 0, zero, d["q"], d["qcodes"], n))
    prof = bench.kernel_profile(s)
  codes, qcodes = np.asarray(d["codes"])[0], np.asarray(d["qcodes"])[0]  # [K, T, L], [K G, L]
  # [K G, T]: head h's candidates among its kv head's tokens (>= 2 tables share the code).
  cand = np.stack([(codes[h // G] == qcodes[h][None]).sum(-1) >= 2 for h in range(K * G)])
  np.testing.assert_array_equal(count[0], cand.sum(-1))
  distinct = sum(int(cand[k * G:(k + 1) * G].any(0).sum()) for k in range(K))
  assert prof["candidates"] == cand.sum() and prof["distinct_candidates"] == distinct
  assert distinct < cand.sum()  # the heads' sets overlap, so the check tells the two apart


def test_reset_num_tokens_memory():
  num_bits, num_tables, K = 6, 12, 2
  d = _make(9, 2, K, 1, 600, [600, 200], num_bits, num_tables, oracle=False)
  est = HostKVStore.estimate_bytes(num_layers=2, num_slots=2, num_kv_heads=K, head_dim=D,
                                   num_bits=num_bits, num_tables=num_tables, capacity=1000,
                                   dtype="float32", threads=2)
  with _store(2, K, num_bits, num_tables, 1000, threads=2) as s:
    empty = s.memory_bytes()
    assert empty < 100_000
    for layer in (0, 1):
      _insert_attend(s, d, jnp.arange(2), layer=layer)
    assert [s.num_tokens(l, b) for l in (0, 1) for b in (0, 1)] == [600, 200, 600, 200]
    full = s.memory_bytes()
    # K and V (f32) of 1600 tokens x 2 heads, plus the tables.
    assert 1600 * K * D * 4 * 2 < full <= est
    s.reset(0)
    assert [s.num_tokens(l, b) for l in (0, 1) for b in (0, 1)] == [0, 200, 0, 200]
    assert s.memory_bytes() < full
    o, lse, count = store_attend(s.handle, 1, jnp.arange(2), d["q"], d["qcodes"], 0)
    assert np.all(np.isneginf(lse[0])) and np.all(count[0] == 0) and np.all(count[1] > 0)
    n = store_insert(s.handle, 1, jnp.asarray([0]), d["k"][:1], d["v"][:1], d["codes"][:1],
                     jnp.asarray([100]), d["mu"][:1])
    np.testing.assert_array_equal(n, [100])
  assert "closed" in repr(s)


# ------------------------------------------------------------------------------------------------
# Inside jit


def test_jit_insert_then_attend_and_hlo():
  num_bits, num_tables, K, G, T = 4, 8, 2, 3, 512
  d = _make(13, 2, K, G, T, [512, 300], num_bits, num_tables)

  @functools.partial(jax.jit, static_argnums=1)
  def step(handle, layer, slots, k, v, codes, lengths, mu, q, qcodes):
    n = store_insert(handle, layer, slots, k, v, codes, lengths, mu)
    return store_attend(handle, layer, slots, q, qcodes, n)

  with _store(2, K, num_bits, num_tables, 2 * T) as s:
    args = (jnp.int32(s.handle), 0, jnp.arange(2), d["k"], d["v"], d["codes"], d["lengths"],
            d["mu"], d["q"], d["qcodes"])
    o, lse, count = step(*args)
    ro, rlse, _ = d["ref"]
    np.testing.assert_allclose(o, ro, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(lse, rlse, rtol=1e-5, atol=1e-4)
    step(*args)  # side effects are not cached away: the second call appends again
    assert s.num_tokens(0, 0) == 2 * T and s.num_tokens(0, 1) == 600

    lowered = step.lower(*args)
    assert "pigjax_insert" in lowered.as_text()
    hlo = lowered.compile().as_text()
    assert hlo.count('custom_call_target="pigjax_insert"') == 1
    assert hlo.count('custom_call_target="pigjax_attend"') == 1
    # No copy of anything pool-sized: the K/V operands reach the custom call in place.
    for line in hlo.splitlines():
      if re.search(r"= \S+ copy\(", line):
        dims = re.search(r"\[([\d,]*)\]", line).group(1)
        size = int(np.prod([int(x) for x in dims.split(",") if x])) if dims else 1
        assert size < T, line


# ------------------------------------------------------------------------------------------------
# Errors


def test_errors_from_the_handler():
  """With the handle as an array (as inside jit) the C++ handler does all the checking."""
  num_bits, num_tables, K = 4, 8, 2
  d = _make(1, 1, K, 1, 20, [20], num_bits, num_tables, oracle=False)
  zero = jnp.zeros(1, jnp.int32)
  with _store(2, K, num_bits, num_tables, 30) as s:
    h = jnp.int32(s.handle)
    closed = s.handle
    ins = lambda **kw: store_insert(**{**dict(
        handle=h, layer=0, slots_B=zero, k_BKTD=d["k"], v_BKTD=d["v"], codes_BKTL=d["codes"],
        lengths_B=d["lengths"], mu_BKD=d["mu"]), **kw}).block_until_ready()
    att = lambda **kw: store_attend(**{**dict(
        handle=h, layer=0, slots_B=zero, q_BHD=d["q"], q_codes_BHL=d["qcodes"], dep=0), **kw})[
            0].block_until_ready()
    with pytest.raises(RuntimeErr, match="unknown store handle 12345"):
      ins(handle=jnp.int32(12345))
    with pytest.raises(RuntimeErr, match=r"unknown store handle"):
      att(handle=jnp.int32(-1))
    with pytest.raises(RuntimeErr, match=r"layer 2 is out of range: the store has 2 sparse"):
      ins(layer=2)
    with pytest.raises(RuntimeErr, match=r"layer -1 is out of range"):
      att(layer=-1)
    with pytest.raises(RuntimeErr, match=r"slot 2 is out of range: the store has 2 slots"):
      ins(slots_B=jnp.asarray([2]))
    with pytest.raises(RuntimeErr, match=r"slot -3 is out of range"):
      att(slots_B=jnp.asarray([-3]))
    with pytest.raises(RuntimeErr, match=r"k has shape \[1, 2, 20, 32\] but expected"):
      ins(k_BKTD=d["k"][..., :32], v_BKTD=d["v"][..., :32], mu_BKD=d["mu"][..., :32])
    with pytest.raises(RuntimeErr, match=r"codes has shape .* but expected"):
      ins(codes_BKTL=d["codes"][..., :4])
    with pytest.raises(RuntimeErr, match=r"q has shape \[1, 3, 64\] but expected"):
      att(q_BHD=jnp.zeros((1, 3, D)), q_codes_BHL=jnp.zeros((1, 3, num_tables), jnp.int32))
    with pytest.raises(RuntimeErr, match=r"code 16 .* is outside \[0, 2\^4\)"):
      ins(codes_BKTL=d["codes"].at[0, 1, 3, 2].set(16))
    with pytest.raises(RuntimeErr, match=r"query code -1 .* is outside"):
      att(q_codes_BHL=d["qcodes"].at[0, 0, 0].set(-1))
    with pytest.raises(RuntimeErr, match=r"lengths\[0\] = 21 is outside \[0, 20\]"):
      ins(lengths_B=jnp.asarray([21]))
    two = lambda x: jnp.concatenate([x, x])
    with pytest.raises(RuntimeErr, match=r"slot 0 appears twice"):
      ins(slots_B=jnp.zeros(2, jnp.int32), k_BKTD=two(d["k"]), v_BKTD=two(d["v"]),
          codes_BKTL=two(d["codes"]), lengths_B=two(d["lengths"]), mu_BKD=two(d["mu"]))
    with pytest.raises(ValueError, match=r"k must be float32 or bfloat16, got float16"):
      ins(k_BKTD=d["k"].astype(jnp.float16))
    # The handler's own dtype checks, reached by calling the target directly.
    raw = lambda *ops: jax.ffi.ffi_call("pigjax_insert", jax.ShapeDtypeStruct(
        (1,), jnp.int32), has_side_effect=True)(*ops, layer=np.int32(0)).block_until_ready()
    with pytest.raises(RuntimeErr, match=r"k must be float32 or bfloat16, got F16"):
      raw(h, zero, d["k"].astype(jnp.float16), d["v"], d["codes"], d["lengths"], d["mu"])
    with pytest.raises(RuntimeErr, match=r"mu must be F32, got BF16"):
      raw(h, zero, d["k"], d["v"], d["codes"], d["lengths"], d["mu"].astype(jnp.bfloat16))
    with pytest.raises(RuntimeErr, match=r"the store handle must be an int32 scalar"):
      raw(jnp.zeros(2, jnp.int32), zero, d["k"], d["v"], d["codes"], d["lengths"], d["mu"])
    with pytest.raises(RuntimeErr, match=r"slots must have rank 1, got rank 2"):
      raw(h, zero[None], d["k"], d["v"], d["codes"], d["lengths"], d["mu"])
    ins()
    with pytest.raises(RuntimeErr, match=r"capacity exceeded: layer 0 slot 0 holds 20 tokens "
                       r"and 20 more would exceed the capacity of 30"):
      ins()
    assert s.num_tokens(0, 0) == 20  # a failed insert changes nothing
    ins(lengths_B=jnp.asarray([10]))
    assert s.num_tokens(0, 0) == 30
  with pytest.raises(RuntimeErr, match="unknown store handle"):  # closed
    ins(handle=jnp.int32(closed))


def test_errors_from_python():
  num_bits, num_tables, K = 4, 8, 2
  d = _make(2, 1, K, 1, 10, [10], num_bits, num_tables, oracle=False)
  zero = jnp.zeros(1, jnp.int32)
  with _store(1, K, num_bits, num_tables, 30) as s:
    with pytest.raises(ValueError, match="layer 5 is out of range"):
      store_insert(s.handle, 5, zero, d["k"], d["v"], d["codes"], d["lengths"], d["mu"])
    with pytest.raises(ValueError, match="layer must be a static Python int"):
      store_attend(s.handle, jnp.int32(0), zero, d["q"], d["qcodes"], 0)
    with pytest.raises(ValueError, match=r"v has shape"):
      store_insert(s.handle, 0, zero, d["k"], d["v"][:, :1], d["codes"], d["lengths"], d["mu"])
    with pytest.raises(ValueError, match=r"k has shape .* \(\[batch, num_kv_heads"):
      store_insert(s.handle, 0, zero, d["k"][:, :1], d["v"][:, :1], d["codes"][:, :1],
                   d["lengths"], d["mu"][:, :1])
    with pytest.raises(ValueError, match=r"q_codes has shape"):
      store_attend(s.handle, 0, zero, d["q"], d["qcodes"][..., :3], 0)
    with pytest.raises(ValueError, match=r"slots has shape \(2,\)"):
      store_attend(s.handle, 0, jnp.zeros(2, jnp.int32), d["q"], d["qcodes"], 0)
    with pytest.raises(ValueError, match=r"slot 1 is out of range"):
      s.reset(1)
    with pytest.raises(ValueError, match=r"layer 2 is out of range"):
      s.num_tokens(2, 0)
  with pytest.raises(ValueError, match="closed"):
    s.num_tokens(0, 0)
  with pytest.raises(ValueError, match="num_bits must be in"):
    _store(1, K, 0, 8, 10)
  with pytest.raises(ValueError, match="num_tables must be >= 2"):
    _store(1, K, 4, 1, 10)
  with pytest.raises(ValueError, match="dtype must be one of"):
    _store(1, K, 4, 8, 10, "float16")
  with pytest.raises(MemoryError, match=r"could need .* GiB .* RAM is available"):
    HostKVStore(num_layers=64, num_slots=64, num_kv_heads=8, head_dim=128, num_bits=10,
                num_tables=150, capacity=1 << 20, verbose=False)


def test_verbose_estimate_line(capsys):
  kw = dict(num_layers=28, num_slots=1, num_kv_heads=3, head_dim=64, num_bits=10, num_tables=150,
            capacity=8192, dtype="bfloat16")
  with HostKVStore(**kw) as s:
    assert s.memory_bytes() < 10 * 2**20  # lazily allocated
  line = capsys.readouterr().out
  est = HostKVStore.estimate_bytes(**kw)
  assert line.startswith(f"pigjax: host KV store up to {est / 2**30:.2f} GiB (")
  # bf16 K and V rows (no per-row header), mu, and per table the CSR offsets and 16-bit ids.
  per_head = 2 * 8192 * 64 * 2 + 64 * 4 + 150 * ((1024 + 1) * 4 + 8192 * 2)
  assert 28 * 3 * per_head <= est < 28 * 3 * per_head + 2**20
