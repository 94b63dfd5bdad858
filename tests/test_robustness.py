"""Robustness: hostile or unlucky inputs that could crash, hang or silently corrupt a run, one
test each.

Cases that could crash or hang the process run in a subprocess with a timeout, so that a
regression is a test failure rather than a dead pytest.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pigjax import config, lsh, reference
from pigjax.config import AttentionConfig, Config
from pigjax.store import HostKVStore, store_attend, store_insert

REPO = Path(__file__).resolve().parents[1]
RuntimeErr = jax.errors.JaxRuntimeError
# The attend has no side effect (pigjax/store.py), so a repeated call takes jax's C++ dispatch
# path, which raises the handler's INVALID_ARGUMENT as ValueError (same message).
AttendErr = (jax.errors.JaxRuntimeError, ValueError)


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
  """Runs `code` in a fresh interpreter; a hang past `timeout` fails the test."""
  try:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"the subprocess hung for {timeout} s; output so far: {e.stdout!r} {e.stderr!r}")


def _store(**kw):
  geometry = dict(num_layers=1, num_slots=2, num_kv_heads=2, head_dim=8, num_bits=3,
                  num_tables=4, capacity=16, dtype="float32", verbose=False)
  return HostKVStore(**{**geometry, **kw})


# ------------------------------------------------------------------------------------------------
# Store geometry overflow: a size product that wraps to 0 would make later calls segfault.


def test_geometry_overflow_is_a_value_error_not_a_segfault():
  out = run_python("""
      from pigjax.store import HostKVStore
      try:
        s = HostKVStore(num_layers=2**21, num_slots=2**21, num_kv_heads=2**22, head_dim=1,
                        num_bits=1, num_tables=2, capacity=1, verbose=False)
      except ValueError as e:
        print("ValueError:", e)
      else:
        s.num_tokens(0, 0)
        s.reset(0)
        print("accepted")
      """)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "ValueError: the store geometry (2097152 layers x 2097152 slots x 4194304 kv heads" in (
      out.stdout)
  assert "more than 2^64 bytes, above the limit of 2^50 bytes" in out.stdout


def test_geometry_limits_name_the_value_and_the_limit():
  big = dict(num_layers=2**20, num_slots=2**20, num_kv_heads=64, head_dim=1, num_bits=1,
             num_tables=2, capacity=1)
  with pytest.raises(ValueError, match=r"needs \d+ bytes, above the limit of 2\^50 bytes"):
    HostKVStore.estimate_bytes(**big)
  # Each factor fits in 32 bits; their product of per-head bytes does not fit the limit.
  with pytest.raises(ValueError, match=r"above the limit of 2\^50 bytes"):
    HostKVStore.estimate_bytes(num_layers=1, num_slots=1, num_kv_heads=1, head_dim=2**31 - 1,
                               num_bits=1, num_tables=2, capacity=2**31 - 1)
  with pytest.raises(ValueError, match=r"num_layers=8589934592 is outside the int32 range"):
    HostKVStore.estimate_bytes(**{**big, "num_layers": 2**33})
  with pytest.raises(ValueError, match=r"capacity must be an int, got 1.5"):
    HostKVStore.estimate_bytes(**{**big, "capacity": 1.5})
  # The estimate stays exact below the limit (a plain product, as before). A pool row is K then
  # V, padded to 16 bytes: 64 bytes for float32 at head_dim 8; int8 rows (16 bytes) have their
  # two f32 scales in a side array (8 bytes).
  ok = dict(num_layers=3, num_slots=2, num_kv_heads=2, head_dim=8, num_bits=3, num_tables=4,
            capacity=16, threads=1)
  for dtype, row_bytes in [("float32", 64), ("bfloat16", 32), ("int8", 16 + 8)]:
    per_head = 16 * row_bytes + 8 * 4 + 4 * ((8 + 1) * 4 + 16 * 2)  # 16-bit table ids
    est = HostKVStore.estimate_bytes(**ok, dtype=dtype)
    assert 12 * per_head < est < 12 * per_head + 12 * 1024 + 64 * 1024, dtype


# ------------------------------------------------------------------------------------------------
# Threads: an upper bound, and no hang when thread creation fails partway.


def test_threads_are_bounded():
  with pytest.raises(ValueError, match=r"threads must be in \[0, 256\] .* got 257"):
    _store(threads=257)
  with pytest.raises(ValueError, match=r"attention.threads must be in \[0, 256\]"):
    config.validate_attention(AttentionConfig(threads=1000))
  with _store(threads=config.MAX_THREADS) as s:
    assert s.threads == config.MAX_THREADS


@pytest.mark.skipif(bool(os.environ.get("PIGJAX_SANITIZED")),
                    reason="ASan reserves terabytes of address space; RLIMIT_AS cannot be used")
def test_failed_thread_start_raises_and_joins_instead_of_hanging():
  # The address-space limit leaves room for a few dozen 8 MiB thread stacks, not 256.
  out = run_python("""
      import resource
      from pigjax.store import HostKVStore
      kw = dict(num_layers=1, num_slots=1, num_kv_heads=1, head_dim=4, num_bits=2, num_tables=2,
                capacity=8, verbose=False)
      status = open("/proc/self/status").read().split("VmSize:")[1].split()[0]
      vm = int(status) * 1024
      resource.setrlimit(resource.RLIMIT_AS, (vm + 256 * 2**20, resource.RLIM_INFINITY))
      resource.setrlimit(resource.RLIMIT_STACK, (8 * 2**20, resource.RLIM_INFINITY))
      try:
        HostKVStore(threads=256, **kw)
        print("created")
      except RuntimeError as e:
        print("RuntimeError:", e)
      with HostKVStore(threads=2, **kw) as s:  # the process is still healthy
        print("then", s.threads, "threads")
      """, timeout=90)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "RuntimeError: could not start worker thread" in out.stdout
  assert "of 256" in out.stdout and "use fewer threads" in out.stdout
  assert "then 2 threads" in out.stdout


# ------------------------------------------------------------------------------------------------
# NaN/Inf keys and queries: an error naming the operand and the first bad index.


def _insert_args(T=5, seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(1, 2, T, 8)).astype(dtype)
  v = rng.normal(size=(1, 2, T, 8)).astype(dtype)
  codes = rng.integers(0, 8, size=(1, 2, T, 4), dtype=np.int32)
  mu = k.astype(np.float32).mean(axis=2)
  return dict(slots_B=np.zeros(1, np.int32), k_BKTD=k, v_BKTD=v, codes_BKTL=codes,
              lengths_B=np.array([T], np.int32), mu_BKD=mu)


@pytest.mark.parametrize("store_dtype", config.STORE_DTYPES)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_non_finite_insert_is_an_error_that_changes_nothing(dtype, store_dtype):
  # The check reads the operands before any conversion, so an int8 store rejects NaN keys too
  # (quantizing would otherwise turn them into garbage codes and scales).
  with _store(dtype=store_dtype) as s:
    h = jnp.int32(s.handle)  # an array handle: the C++ handler does the checking
    ins = lambda **kw: store_insert(h, 0, **{**_insert_args(dtype=dtype), **kw}).block_until_ready()
    a = _insert_args(dtype=dtype)
    k = a["k_BKTD"].copy()
    k[0, 1, 3, 5] = np.nan
    with pytest.raises(RuntimeErr, match=r"store_insert: k\[0, 1, 3, 5\] = nan is not finite"):
      ins(k_BKTD=k)
    v = a["v_BKTD"].copy()
    v[0, 0, 2, 0] = -np.inf
    with pytest.raises(RuntimeErr, match=r"store_insert: v\[0, 0, 2, 0\] = -inf is not finite"):
      ins(v_BKTD=v)
    mu = a["mu_BKD"].copy()
    mu[0, 1, 7] = np.inf
    with pytest.raises(RuntimeErr, match=r"store_insert: mu\[0, 1, 7\] = inf is not finite"):
      ins(mu_BKD=mu)
    assert s.num_tokens(0, 0) == 0  # a rejected insert changes nothing
    # Tokens past lengths[b] are never read, so they may hold anything.
    k = a["k_BKTD"].copy()
    k[0, 0, 4] = np.nan
    ins(k_BKTD=k, lengths_B=np.array([4], np.int32))
    assert s.num_tokens(0, 0) == 4


def test_non_finite_query_is_an_error_in_the_store_and_the_reference():
  with _store() as s:
    h = jnp.int32(s.handle)
    a = _insert_args()
    dep = store_insert(h, 0, **a)
    rng = np.random.default_rng(1)
    q = rng.normal(size=(1, 4, 8)).astype(np.float32)
    qcodes = rng.integers(0, 8, size=(1, 4, 4), dtype=np.int32)
    o, lse, count = store_attend(h, 0, np.zeros(1, np.int32), q, qcodes, dep)
    assert np.all(np.isfinite(np.asarray(o)))
    for bad in (np.nan, np.inf):
      q_bad = q.copy()
      q_bad[0, 2, 6] = bad
      with pytest.raises(AttendErr, match=rf"store_attend: q\[0, 2, 6\] = {bad} is not finite"):
        store_attend(h, 0, np.zeros(1, np.int32), q_bad, qcodes, dep)[0].block_until_ready()
      with pytest.raises(AttendErr, match=r"store_attend: q\[0, 2, 6\] = .* is not finite"):
        store_attend(h, 0, np.zeros(1, np.int32), q_bad.astype(jnp.bfloat16), qcodes,
                     dep)[0].block_until_ready()
  # The pure-jnp reference applies the same policy on concrete inputs.
  w = lsh.simhash_matrix(0, 0, 8, 3, 4)
  valid = np.ones((1, 2, 5), bool)
  q_bad = q.copy()
  q_bad[0, 2, 6] = np.nan
  with pytest.raises(ValueError, match=r"pool_attention_ref: q\[0, 2, 6\] = nan is not finite"):
    reference.pool_attention_ref(q_bad, a["k_BKTD"], a["v_BKTD"], valid, a["mu_BKD"], w, 3, 4)
  k = a["k_BKTD"].copy()
  k[0, 1, 4, 0] = np.inf
  with pytest.raises(ValueError, match=r"pool_attention_ref: k\[0, 1, 4, 0\] = inf"):
    reference.pool_attention_ref(q, k, a["v_BKTD"], valid, a["mu_BKD"], w, 3, 4)
  valid[0, 1, 4] = False  # an invalid token may hold anything, as in the store
  reference.pool_attention_ref(q, k, a["v_BKTD"], valid, a["mu_BKD"], w, 3, 4)


# ------------------------------------------------------------------------------------------------
# Attention settings are validated for every kind, against one list of store dtypes.


def test_attention_settings_are_checked_for_every_kind():
  from pigjax import pipeline
  for kind in config.ATTENTION_KINDS:
    cfg = Config(attention=AttentionConfig(kind=kind, store_dtype="float16"))
    with pytest.raises(ValueError, match=r"attention.store_dtype must be one of \('bfloat16', "
                       r"'float32', 'int8'\), got 'float16'"):
      pipeline.validate(cfg)
  with pytest.raises(ValueError, match=r"attention.num_bits must be in \[1, 16\], got 0"):
    pipeline.validate(Config(attention=AttentionConfig(num_bits=0)))
  with pytest.raises(ValueError, match=r"attention.kind must be one of"):
    pipeline.validate(Config(attention=AttentionConfig(kind="sparse")))
  with pytest.raises(ValueError, match=r"dense_layers \[30\] out of range for a 30-layer model"):
    config.validate_attention(AttentionConfig(dense_layers=(0, 30)), num_layers=30)
  # The store checks its dtype against the same tuple.
  with pytest.raises(ValueError, match=r"dtype must be one of \('bfloat16', 'float32', 'int8'\)"):
    _store(dtype="float16")
  for dtype in config.STORE_DTYPES:
    with _store(dtype=dtype) as s:
      assert s.dtype == dtype


# ------------------------------------------------------------------------------------------------
# MagicPIG's after_prefill peak: one sparse layer's hashing alive at a time, not every layer's.


def test_split_prefill_hashes_one_layer_at_a_time():
  """The compiled after_prefill program's scratch holds about one layer's hash projection, not
  one per sparse layer (which cost SmolLM2 1.5 GB at a 2.6k-token prompt)."""
  from pigjax.attention import DenseCache
  from pigjax.config import ModelConfig
  from pigjax.magicpig import MagicPigBackend
  B, K, D, S, num_bits, num_tables, layers = 1, 2, 16, 1024, 6, 20, 8
  cfg = Config(model=ModelConfig(num_layers=layers, num_kv_heads=K, num_heads=2 * K, head_dim=D),
               attention=AttentionConfig(kind="magicpig", num_bits=num_bits,
                                         num_tables=num_tables, dense_layers=(0,), sink=2,
                                         window=8, generated_buffer=16))
  backend = MagicPigBackend(cfg)
  cache = backend.create_cache(B, S, jnp.float32)
  compiled = jax.jit(backend.split_prefill, donate_argnums=(0,)).lower(
      cache, jnp.int32(backend.store.handle)).compile()
  backend.store.close()
  projection_bytes = B * K * S * num_bits * num_tables * 4  # f32 [B, K, P, num_bits*num_tables]
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < 3 * projection_bytes, (temp, projection_bytes)  # 7 sparse layers: >= 7x before
