"""Store creation against hostile geometries (run by tests/test_fuzz.py in a subprocess, so a
crash here is a failed test rather than a dead pytest; not collected by the main run).

Property: `HostKVStore(...)` and `HostKVStore.estimate_bytes(...)` raise ValueError (a bad
setting, named), TypeError (not a number) or MemoryError (does not fit), and agree; or the store
works: every host-side call succeeds on every layer and slot.
"""

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from pigjax.store import HostKVStore

# Creations whose worst case exceeds this are only estimated, never built: the fuzz must not
# allocate gigabytes on a shared machine (MemoryError against available RAM is tested in
# tests/test_store.py).
BUILD_LIMIT = 64 * 2**20

EDGE_INTS = [-(2**63), -(2**31), -1, 0, 1, 2, 3, 2**20, 2**21, 2**22, 2**31 - 1, 2**31, 2**63]


def _int(small):
  return st.one_of(st.sampled_from(EDGE_INTS), small, st.sampled_from([1.5, None, True, "2"]))


@given(num_layers=_int(st.integers(1, 4)), num_slots=_int(st.integers(1, 4)),
       num_kv_heads=_int(st.integers(1, 4)), head_dim=_int(st.integers(1, 64)),
       num_bits=_int(st.integers(0, 25)), num_tables=_int(st.integers(0, 200)),
       capacity=_int(st.integers(0, 4096)),
       dtype=st.sampled_from(["bfloat16", "float32", "int8", "float16", "", None]),
       threads=_int(st.integers(0, 300)))
@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
def test_creation_is_an_error_or_a_working_store(**kw):
  try:
    est = HostKVStore.estimate_bytes(**kw)
  except (ValueError, TypeError) as e:
    assert str(e)
    try:
      HostKVStore(**kw, verbose=False)
    except (ValueError, TypeError) as e2:
      assert type(e2) is type(e) and str(e2) == str(e)
    else:
      raise AssertionError(f"estimate_bytes rejected {kw} ({e}) but the constructor accepted it")
    return
  assert 0 < est <= 2**50
  if est > BUILD_LIMIT:
    return
  try:
    s = HostKVStore(**kw, verbose=False)
  except (MemoryError, RuntimeError) as e:  # no RAM, or threads could not start
    assert str(e)
    return
  with s:
    assert 1 <= s.threads <= 256
    for layer in range(s.num_layers):
      for slot in range(s.num_slots):
        assert s.num_tokens(layer, slot) == 0
    for slot in range(s.num_slots):
      s.reset(slot)
    assert 0 <= s.memory_bytes() <= est
    assert np.isfinite(est)
