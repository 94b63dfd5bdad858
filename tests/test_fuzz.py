"""Property tests (hypothesis) of the host store and its FFI calls against hostile input.

The property, for every operand and argument (handles, layers, slots, lengths, shapes, dtypes,
codes in and out of range, NaN/Inf, empty and full pools, capacities, thread counts): the call
either does exactly what a valid call does, or raises a clear Python exception (ValueError,
MemoryError, or the handler's INVALID_ARGUMENT as JaxRuntimeError) and changes nothing. Never a
crash, a hang or a silent wrong answer. Each case is classified valid or invalid by an
independent model of the rules below, so an invalid input that is accepted fails the test too.

Store creation, where a crash is likeliest (it allocates and starts threads), runs in a
subprocess (tests/fuzz_store_creation.py) so that a crash there is a failure, not a dead pytest.
The sanitizer build (scripts/sanitize.sh) runs this file under ASan + UBSan.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from pigjax.config import STORE_DTYPES
from pigjax.store import HostKVStore, store_attend, store_insert

REPO = Path(__file__).resolve().parents[1]
RuntimeErr = jax.errors.JaxRuntimeError
GEOM = dict(num_layers=2, num_slots=3, num_kv_heads=2, head_dim=8, num_bits=3, num_tables=4,
            capacity=24)
NB = 2**GEOM["num_bits"]
# PIGJAX_FUZZ_EXAMPLES=1000 for a deeper, randomised search (CI runs the fixed 60).
_DEEP = int(os.environ.get("PIGJAX_FUZZ_EXAMPLES", "0"))
FAST = settings(max_examples=_DEEP or 60, deadline=None, derandomize=not _DEEP,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16,
          "int32": np.int32}


def _rejected(fn):
  """Runs fn; returns the exception if it was a clear, expected one, None if fn succeeded."""
  try:
    fn()
  except (ValueError, RuntimeErr) as e:
    assert str(e).strip(), "an error without a message"
    return e
  return None


def _store_with(dtype, fill):
  """A store with `fill[slot]` random tokens in each slot of layer 0 (fill may reach capacity)."""
  s = HostKVStore(**GEOM, dtype=dtype, threads=2, verbose=False)
  rng = np.random.default_rng(len(fill) + sum(fill))
  B, K, D, L = len(fill), GEOM["num_kv_heads"], GEOM["head_dim"], GEOM["num_tables"]
  T = max(max(fill), 1)
  k = rng.normal(size=(B, K, T, D)).astype(np.float32)
  store_insert(s.handle, 0, np.arange(B, dtype=np.int32), k, rng.normal(size=k.shape).astype(
      np.float32), rng.integers(0, NB, size=(B, K, T, L), dtype=np.int32),
               np.asarray(fill, np.int32), k.mean(axis=2)).block_until_ready()
  return s


def _inject(rng, x, what):
  """x with one element set to `what` (nan / inf / -inf) at a random index; (x, flat index)."""
  x = np.array(x, copy=True)
  if what is None or x.size == 0:
    return x, None
  i = int(rng.integers(0, x.size))
  x.reshape(-1)[i] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[what]
  return x, i


# ------------------------------------------------------------------------------------------------
# Insert


def _faults(draw, names):
  """No fault (half the cases) or one or two faults drawn from names."""
  return draw(st.one_of(st.just([]), st.lists(st.sampled_from(names), min_size=1, max_size=2)))


INSERT_FAULTS = ["handle", "layer", "K", "D", "L", "k_dtype", "v_dtype", "mu_dtype", "bad_code",
                 "nonfinite", "slot_range", "slot_twice", "slots_size", "lengths_size",
                 "length_range", "full"]


@st.composite
def insert_cases(draw):
  """A valid insert, then zero to two faults; the test classifies the result independently."""
  B, T = draw(st.integers(0, 3)), draw(st.integers(0, 9))
  c = dict(route=draw(st.sampled_from(["wrapper", "raw"])), handle="ok", layer=draw(
      st.sampled_from([0, 1])), B=B, T=T, K=2, D=8, L=4, k_dtype=draw(st.sampled_from(
          ["float32", "bfloat16"])), v_dtype=draw(st.sampled_from(["float32", "bfloat16"])),
           mu_dtype="float32", bad_code=None, nonfinite=None, nonfinite_in="k",
           prefill=draw(st.lists(st.sampled_from([0, 3, 10]), min_size=3, max_size=3)),
           store_dtype=draw(st.sampled_from(STORE_DTYPES)),
           seed=draw(st.integers(0, 2**31)),
           slots=draw(st.permutations(range(3)))[:B],
           lengths=draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
  for f in _faults(draw, INSERT_FAULTS):
    if f == "handle":
      c["handle"] = draw(st.sampled_from(["closed", "bogus"]))
    elif f == "layer":
      c["layer"] = draw(st.sampled_from([-1, 2, 2**31 - 1, -2**31]))
    elif f in ("K", "D", "L"):
      c[f] += draw(st.sampled_from([-1, 1]))
    elif f in ("k_dtype", "v_dtype"):
      c[f] = draw(st.sampled_from(["float16", "int32"]))
    elif f == "mu_dtype":
      c[f] = "bfloat16"
    elif f == "bad_code":
      c[f] = draw(st.sampled_from([-1, NB, 2**31 - 1, -2**31]))
    elif f == "nonfinite":
      c[f] = draw(st.sampled_from(["nan", "inf", "-inf"]))
      c["nonfinite_in"] = draw(st.sampled_from(["k", "v", "mu"]))
    elif f == "slot_range" and B:
      c["slots"][draw(st.integers(0, B - 1))] = draw(st.sampled_from([-1, 3, 2**31 - 1]))
    elif f == "slot_twice" and B >= 2:
      c["slots"][1] = c["slots"][0]
    elif f in ("slots_size", "lengths_size"):
      key = f.split("_")[0]
      c[key] = c[key][:-1] if c[key] and draw(st.booleans()) else [*c[key], 0]
    elif f == "length_range" and B:
      c["lengths"][draw(st.integers(0, B - 1))] = draw(st.sampled_from([-1, T + 1, 2**31 - 1]))
    elif f == "full":
      c["prefill"] = [24, 24, 24] if draw(st.booleans()) else [20, 20, 20]
  return c


@given(insert_cases())
@FAST
def test_insert_accepts_exactly_the_valid_calls(c):
  rng = np.random.default_rng(c["seed"])
  B, T, K, D, L = c["B"], c["T"], c["K"], c["D"], c["L"]
  s = _store_with(c["store_dtype"], c["prefill"])
  k = rng.normal(size=(B, K, T, D)).astype(DTYPES[c["k_dtype"]])
  v = rng.normal(size=(B, K, T, D)).astype(DTYPES[c["v_dtype"]])
  mu = rng.normal(size=(B, K, D)).astype(np.float32)
  codes = rng.integers(0, NB, size=(B, K, T, L), dtype=np.int32)
  bad_at = None
  if c["bad_code"] is not None and codes.size:
    bad_at = np.unravel_index(int(rng.integers(0, codes.size)), codes.shape)
    codes[bad_at] = c["bad_code"]
  nonfinite_at = None
  if c["nonfinite"] and c["k_dtype"] != "int32":
    name = c["nonfinite_in"]
    arr = {"k": k, "v": v, "mu": mu}[name]
    arr, i = _inject(rng, arr.astype(np.float32), c["nonfinite"])
    arr = arr.astype({"k": k, "v": v, "mu": mu}[name].dtype)
    k, v, mu = (arr if name == n else x for n, x in (("k", k), ("v", v), ("mu", mu)))
    if i is not None:
      nonfinite_at = (name, np.unravel_index(i, arr.shape))
  mu = mu.astype(DTYPES[c["mu_dtype"]]) if c["route"] == "raw" else mu
  slots = np.asarray(c["slots"], np.int32)
  lengths = np.asarray(c["lengths"], np.int32)
  handle = {"ok": s.handle, "closed": -5, "bogus": 987654}[c["handle"]]
  before = [[s.num_tokens(l, slot) for slot in range(3)] for l in range(2)]

  # The rules, modelled independently of the code under test.
  valid = (c["handle"] == "ok" and 0 <= c["layer"] < 2 and (K, D, L) == (2, 8, 4)
           and c["k_dtype"] in ("float32", "bfloat16") and c["v_dtype"] in ("float32", "bfloat16")
           and (c["mu_dtype"] == "float32" or c["route"] == "wrapper"))  # the wrapper casts mu
  valid = valid and len(slots) == B and len(lengths) == B
  if valid:
    valid = (all(0 <= x < 3 for x in slots) and len(set(slots.tolist())) == B
             and all(0 <= n <= T for n in lengths))
  if valid:
    valid = all(before[c["layer"]][sl] + n <= GEOM["capacity"] for sl, n in zip(slots, lengths))
    if bad_at is not None and bad_at[2] < lengths[bad_at[0]]:
      valid = False  # codes past lengths[b] are never read
    if nonfinite_at is not None:
      name, idx = nonfinite_at
      if name == "mu":
        valid = valid and lengths[idx[0]] == 0
      else:
        valid = valid and idx[2] >= lengths[idx[0]]

  event(f"insert valid={valid}")
  if c["route"] == "wrapper":
    h = jnp.int32(handle)  # an array handle: the handler, not Python, checks it
    call = lambda: store_insert(h, c["layer"], slots, k, v, codes, lengths,
                                mu).block_until_ready()
  else:
    out = jax.ShapeDtypeStruct((max(B, 0),), jnp.int32)
    call = lambda: jax.ffi.ffi_call("pigjax_insert", out, has_side_effect=True)(
        jnp.int32(handle), slots, k, v, codes, lengths, mu,
        layer=np.int32(c["layer"])).block_until_ready()
  result = []
  err = _rejected(lambda: result.append(np.asarray(call())))
  after = [[s.num_tokens(l, slot) for slot in range(3)] for l in range(2)]
  s.close()
  if valid:
    assert err is None, f"a valid insert was rejected: {err}"
    want = [before[c["layer"]][sl] + n for sl, n in zip(slots, lengths)]
    assert result[0].tolist() == want
    for sl, n in zip(slots, lengths):
      before[c["layer"]][sl] += n
    assert after == before
  else:
    assert err is not None, f"an invalid insert was accepted: {c}"
    assert after == before, "a rejected insert changed the store"


# ------------------------------------------------------------------------------------------------
# Attend


ATTEND_FAULTS = ["handle", "layer", "H", "D", "L", "q_dtype", "bad_code", "nonfinite",
                 "slot_range", "slots_size"]


@st.composite
def attend_cases(draw):
  """A valid attend, then zero to two faults; the test classifies the result independently."""
  B = draw(st.integers(0, 4))
  c = dict(handle="ok", layer=draw(st.sampled_from([0, 0, 1])), B=B,
           H=draw(st.sampled_from([2, 4, 6])), D=8, L=4,
           q_dtype=draw(st.sampled_from(["float32", "bfloat16"])), bad_code=None, nonfinite=None,
           # Pools from empty to full (capacity 24), with layer 1 always empty.
           fill=draw(st.lists(st.sampled_from([0, 1, 5, 24]), min_size=3, max_size=3)),
           store_dtype=draw(st.sampled_from(STORE_DTYPES)),
           seed=draw(st.integers(0, 2**31)),
           slots=draw(st.lists(st.integers(0, 2), min_size=B, max_size=B)))
  for f in _faults(draw, ATTEND_FAULTS):
    if f == "handle":
      c["handle"] = draw(st.sampled_from(["closed", "bogus"]))
    elif f == "layer":
      c["layer"] = draw(st.sampled_from([-1, 2, 2**31 - 1]))
    elif f == "H":
      c["H"] = draw(st.sampled_from([0, 1, 3]))
    elif f in ("D", "L"):
      c[f] += draw(st.sampled_from([-1, 1]))
    elif f == "q_dtype":
      c[f] = "float16"
    elif f == "bad_code":
      c[f] = draw(st.sampled_from([-1, NB, 2**31 - 1]))
    elif f == "nonfinite":
      c[f] = draw(st.sampled_from(["nan", "inf", "-inf"]))
    elif f == "slot_range" and B:
      c["slots"][draw(st.integers(0, B - 1))] = draw(st.sampled_from([-1, 3, 2**31 - 1]))
    elif f == "slots_size":
      c["slots"] = c["slots"][:-1] if c["slots"] and draw(st.booleans()) else [*c["slots"], 0]
  return c


@given(attend_cases())
@FAST
def test_attend_accepts_exactly_the_valid_calls(c):
  rng = np.random.default_rng(c["seed"])
  B, H, D, L = c["B"], c["H"], c["D"], c["L"]
  s = _store_with(c["store_dtype"], c["fill"])
  q = rng.normal(size=(B, H, D)).astype(np.float32)
  q, nonfinite_at = _inject(rng, q, c["nonfinite"])
  q = q.astype(DTYPES[c["q_dtype"]])
  qcodes = rng.integers(0, NB, size=(B, H, L), dtype=np.int32)
  if c["bad_code"] is not None and qcodes.size:
    qcodes.reshape(-1)[int(rng.integers(0, qcodes.size))] = c["bad_code"]
  slots = np.asarray(c["slots"], np.int32)
  handle = {"ok": s.handle, "closed": -5, "bogus": 987654}[c["handle"]]
  valid = (c["handle"] == "ok" and 0 <= c["layer"] < 2 and D == 8 and L == 4 and H >= 1
           and H % 2 == 0 and c["q_dtype"] in ("float32", "bfloat16") and len(slots) == B
           and all(0 <= x < 3 for x in slots) and nonfinite_at is None
           and (c["bad_code"] is None or qcodes.size == 0))
  if B == 0:  # q and codes are empty: the shape checks are all that apply
    valid = valid or (c["handle"] == "ok" and 0 <= c["layer"] < 2 and D == 8 and L == 4
                      and H >= 1 and H % 2 == 0 and c["q_dtype"] in ("float32", "bfloat16")
                      and len(slots) == 0)
  event(f"attend valid={valid}")
  result = []
  err = _rejected(lambda: result.append([np.asarray(x) for x in store_attend(
      jnp.int32(handle), c["layer"], slots, q, qcodes, 0)]))
  pool = [[s.num_tokens(l, slot) for slot in range(3)] for l in range(2)]
  s.close()
  if not valid:
    assert err is not None, f"an invalid attend was accepted: {c}"
    return
  assert err is None, f"a valid attend was rejected: {err}"
  o, lse, count = result[0]
  assert o.shape == (B, H, D) and lse.shape == count.shape == (B, H)
  for b, slot in enumerate(slots):
    n = pool[c["layer"]][slot]
    assert np.all((0 <= count[b]) & (count[b] <= n))
    empty = count[b] == 0
    assert np.all(np.isfinite(o[b])) and np.all(o[b][empty] == 0)
    assert np.all(np.isneginf(lse[b][empty])) and np.all(np.isfinite(lse[b][~empty]))


# ------------------------------------------------------------------------------------------------
# Host-side calls and store creation


@given(op=st.sampled_from(["reset", "num_tokens", "memory_bytes", "profile"]),
       layer=st.sampled_from([0, 1, -1, 2, 2**40]), slot=st.sampled_from([0, 2, -1, 3, 2**40]),
       closed=st.booleans())
@FAST
def test_host_side_calls_check_every_argument(op, layer, slot, closed):
  s = HostKVStore(**GEOM, threads=1, verbose=False)
  if closed:
    s.close()
  ok_layer, ok_slot = 0 <= layer < 2, 0 <= slot < 3
  calls = {"reset": (lambda: s.reset(slot), ok_slot),
           "num_tokens": (lambda: s.num_tokens(layer, slot), ok_layer and ok_slot),
           "memory_bytes": (s.memory_bytes, True),
           "profile": (lambda: s.__repr__(), True)}
  fn, ok = calls[op]
  try:
    fn()
    raised = None
  except (ValueError, TypeError, OverflowError) as e:
    raised = e
  s.close()
  if op == "profile":
    assert raised is None
  elif closed or not ok:
    assert raised is not None
  else:
    assert raised is None


def test_store_creation_fuzz_in_a_subprocess():
  """Hostile geometries, dtypes and thread counts (tests/fuzz_store_creation.py)."""
  try:
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/fuzz_store_creation.py"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"store creation hung: {e.stdout!r}")
  assert out.returncode == 0, (out.returncode, out.stdout[-3000:], out.stderr[-3000:])
  assert " passed" in out.stdout
