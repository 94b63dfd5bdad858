"""The host KV store and its FFI calls (docs/design.md, "The host store").

MagicPIG keeps the long middle of the KV cache (the *pool*) in host memory and attends to it by
LSH sampling (arXiv 2410.16179, section 4). `HostKVStore` owns, per sparse layer, batch slot and
KV head, the pool's keys and values, the norms |k - mu| of the centred keys, the mean key mu and
one CSR bucket -> token-ids table per LSH table. It lives in C++ (xla_ffi/store.h) and is named
inside jitted programs by an int32 handle, because `ffi::State` is per executable and a store is
shared by the prefill and decode programs.

`store_insert` appends tokens (keys hashed in JAX) and extends the tables; `store_attend` looks the
query's codes up in the tables and computes importance-weighted attention over the candidates
(docs/design.md, "The algorithm", steps 5-8). A store created with `estimator="proxy"`
(pigjax/estimators/proxy.py) builds no tables: the insert quantizes the centred keys into a 4-bit
(`proxy_bits`) index, and the attend scans it, attends the top `proxy_fraction` of the pool
exactly and adds the mean-V tail; its code operands have 0 columns (`code_columns`).

Both are `jax.ffi.ffi_call`s. The insert has side effects (XLA must run it even though its output
may go unused); the attend is a pure read, and one that must see an insert takes the insert's
output as its `dep` operand.

Shape letters: B batch rows, K kv heads, H query heads, T tokens, D head dim, L tables.
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np

from pigjax import _ffi  # noqa: F401  (registers the FFI targets)
from pigjax import _pigjax_ffi
from pigjax.config import ESTIMATORS, PROXY_TAILS, STORE_DTYPES, AttentionConfig

_INT32_MAX = 2**31 - 1
_DTYPE = AttentionConfig.store_dtype  # the pool dtype a store gets when none is named
_FLOAT_INPUTS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

# Open stores by handle, so the wrappers can check static shapes against a known store early.
_OPEN: weakref.WeakValueDictionary[int, HostKVStore] = weakref.WeakValueDictionary()


def _check_geometry(geometry: dict, threads, estimator: dict) -> None:
  """Python ints that fit the C++ int fields; the store's own checks then name any bad value."""
  if estimator["estimator"] not in ESTIMATORS:
    raise ValueError(f"HostKVStore estimator must be one of {ESTIMATORS}, got "
                     f"{estimator['estimator']!r}.")
  if estimator["proxy_tail"] not in PROXY_TAILS:
    raise ValueError(f"HostKVStore proxy_tail must be one of {PROXY_TAILS}, got "
                     f"{estimator['proxy_tail']!r}.")
  if not 0.0 < float(estimator["proxy_fraction"]) <= 1.0:
    raise ValueError(f"HostKVStore proxy_fraction must be in (0, 1], got "
                     f"{estimator['proxy_fraction']!r}.")
  for name, value in [*geometry.items(), ("threads", threads),
                      ("proxy_bits", estimator["proxy_bits"])]:
    if name == "dtype":
      if value not in STORE_DTYPES:
        raise ValueError(f"HostKVStore dtype must be one of {STORE_DTYPES}, got {value!r}.")
      continue
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise ValueError(f"HostKVStore {name} must be an int, got {value!r}.")
    if not -_INT32_MAX <= value <= _INT32_MAX:
      raise ValueError(f"HostKVStore {name}={value} is outside the int32 range the store takes.")


def available_bytes() -> int | None:
  """MemAvailable from /proc/meminfo, or None where there is no such file."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


class HostKVStore:
  """MagicPIG's host-resident pool for every sparse layer and batch slot.

  Args:
    num_layers: number of SPARSE layers; store layers are 0..num_layers-1 (the model maps its
      layer ids onto these).
    num_slots: batch slots.
    num_kv_heads, head_dim: attention geometry.
    num_bits, num_tables: K bits per table and L tables of the SimHash codes.
    capacity: most pool tokens per (layer, slot).
    dtype: K/V storage, one of config.STORE_DTYPES: "int8" (default; one float32 scale per K
      row and per V row, `reference.quantize_int8_rows`), "bfloat16" or "float32". Norms, means and
      math are float32.
    threads: 0 (default): run on the process's compute pool (all hardware threads, the pool
      the quantized matmuls and the dense decode kernel use, so one set of workers stays awake
      through a decode step); N in 1..256: a pool of the store's own with N threads.
    estimator: one of config.ESTIMATORS. "proxy" builds no LSH tables (num_bits and num_tables
      are then unused; codes operands have 0 columns) but a `proxy_bits` index of the centred
      keys; its attend reads the top `proxy_fraction` of the pool exactly, plus the mean-V tail
      when `proxy_tail` is "mean".
    verbose: print the worst-case memory estimate.

  Raises:
    ValueError: a bad setting (including a geometry whose size would exceed 2^50 bytes).
    MemoryError: the worst case would not fit in available RAM. RuntimeError: the worker threads
    could not be started.
  """

  def __init__(self, *, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
               num_bits: int, num_tables: int, capacity: int, dtype: str = _DTYPE,
               threads: int = 0, estimator: str = "magicpig", proxy_bits: int = 4,
               proxy_fraction: float = 0.03, proxy_tail: str = "mean", verbose: bool = True):
    self.handle = -1
    geometry = dict(num_layers=num_layers, num_slots=num_slots, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, num_bits=num_bits, num_tables=num_tables,
                    capacity=capacity, dtype=dtype)
    est_cfg = dict(estimator=estimator, proxy_bits=proxy_bits,
                   proxy_fraction=float(proxy_fraction), proxy_tail=proxy_tail)
    _check_geometry(geometry, threads, est_cfg)
    est = _pigjax_ffi.store_estimate_bytes(*geometry.values(), threads, *est_cfg.values())
    if verbose:
      index = (f"{num_tables} tables of 2^{num_bits} buckets" if estimator == "magicpig" else
               f"a {proxy_bits}-bit proxy index, {proxy_fraction:g} of the pool read")
      print(f"pigjax: host KV store up to {est / 2**30:.2f} GiB ({num_layers} layers x "
            f"{num_slots} slots x {num_kv_heads} kv heads x {capacity} tokens, {dtype} K/V, "
            f"{index})")
    avail = available_bytes()
    if avail is not None and est > avail:
      raise MemoryError(
          f"The host KV store could need {est / 2**30:.2f} GiB (capacity {capacity} tokens x "
          f"{num_slots} slots x {num_layers} sparse layers) but only {avail / 2**30:.2f} GiB of "
          f"RAM is available; lower the capacity (max_seq_len), the batch size or num_tables, or "
          f"store K/V as bfloat16 or int8.")
    self.handle = int(_pigjax_ffi.store_create(*geometry.values(), threads, *est_cfg.values()))
    for name, value in {**geometry, **est_cfg}.items():
      setattr(self, name, value)
    self.threads = _pigjax_ffi.store_num_threads(self.handle)
    self.isa = _pigjax_ffi.store_isa(self.handle)  # "avx2" or "scalar": the kernels in use
    _OPEN[self.handle] = self

  @staticmethod
  def estimate_bytes(*, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                     num_bits: int, num_tables: int, capacity: int, dtype: str = _DTYPE,
                     threads: int = 0, estimator: str = "magicpig", proxy_bits: int = 4,
                     proxy_fraction: float = 0.03, proxy_tail: str = "mean") -> int:
    """Worst-case bytes (every pool full, plus per-thread scratch).

    Raises ValueError for a geometry the store rejects, including one whose size would exceed
    2^50 bytes (or overflow 64 bits).
    """
    geometry = dict(num_layers=num_layers, num_slots=num_slots, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, num_bits=num_bits, num_tables=num_tables,
                    capacity=capacity, dtype=dtype)
    est_cfg = dict(estimator=estimator, proxy_bits=proxy_bits,
                   proxy_fraction=float(proxy_fraction), proxy_tail=proxy_tail)
    _check_geometry(geometry, threads, est_cfg)
    return int(_pigjax_ffi.store_estimate_bytes(*geometry.values(), threads, *est_cfg.values()))

  @property
  def code_columns(self) -> int:
    """Last dimension of the codes operands: num_tables, or 0 for the proxy estimator."""
    return 0 if self.estimator == "proxy" else self.num_tables

  def _live(self) -> int:
    if self.handle < 0:
      raise ValueError("This HostKVStore is closed.")
    return self.handle

  def reset(self, slot: int) -> None:
    """Empties `slot`'s pool in every layer and frees its memory.

    Host-side calls (this one, `num_tokens`, `memory_bytes`) run at once: they are not ordered
    after inserts or attends that jax has dispatched but not yet run, so block on those first.
    """
    _pigjax_ffi.store_reset(self._live(), slot)

  def num_tokens(self, layer: int, slot: int) -> int:
    """Pool tokens in (layer, slot)."""
    return int(_pigjax_ffi.store_num_tokens(self._live(), layer, slot))

  def memory_bytes(self) -> int:
    """Bytes currently allocated (pools grow geometrically up to the capacity)."""
    return int(_pigjax_ffi.store_memory_bytes(self._live()))

  def close(self) -> None:
    """Frees the store; its handle becomes invalid (later FFI calls with it fail cleanly)."""
    if self.handle >= 0:
      _OPEN.pop(self.handle, None)
      _pigjax_ffi.store_free(self.handle)
      self.handle = -1

  def __enter__(self) -> HostKVStore:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    try:
      self.close()
    except Exception:  # interpreter shutdown
      pass

  def __repr__(self) -> str:
    if self.handle < 0:
      return "HostKVStore(closed)"
    return (f"HostKVStore(handle={self.handle}, estimator={self.estimator}, "
            f"layers={self.num_layers}, "
            f"slots={self.num_slots}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"num_bits={self.num_bits}, num_tables={self.num_tables}, "
            f"capacity={self.capacity}, dtype={self.dtype}, threads={self.threads})")


# ------------------------------------------------------------------------------------------------
# FFI calls


def _handle_operand(handle) -> tuple[jax.Array, HostKVStore | None]:
  """int32 scalar operand, and the store when the handle is a concrete known int."""
  if isinstance(handle, HostKVStore):
    handle = handle.handle
  store = None
  if isinstance(handle, (int, np.integer)):
    store = _OPEN.get(int(handle))
  if jnp.ndim(handle) != 0:
    raise ValueError(f"The store handle must be a scalar, got shape {jnp.shape(handle)}.")
  return jnp.asarray(handle, jnp.int32), store


def _check_layer(layer, store: "HostKVStore | None") -> int:
  """A static int layer, in range when the store is known here."""
  if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool):
    raise ValueError(f"layer must be a static Python int, got {type(layer).__name__}.")
  if store is not None and not 0 <= layer < store.num_layers:
    raise ValueError(f"layer {layer} is out of range: the store has {store.num_layers} sparse "
                     f"layers.")
  return int(layer)


def _check_float(name: str, x) -> None:
  if jnp.dtype(x.dtype) not in _FLOAT_INPUTS:
    raise ValueError(f"{name} must be float32 or bfloat16, got {x.dtype}.")


def _check_shape(name: str, x, want: tuple, what: str) -> None:
  if tuple(x.shape) != tuple(want):
    raise ValueError(f"{name} has shape {tuple(x.shape)} but expected {tuple(want)} ({what}).")


def store_insert(handle, layer: int, slots_B, k_BKTD, v_BKTD, codes_BKTL, lengths_B,
                 mu_BKD) -> jax.Array:
  """Appends the first lengths_B[b] tokens of each row to the pool of (layer, slots_B[b]).

  Stores K/V (in the store dtype), |k - mu| and mu, and extends the (layer, slot) tables per kv
  head and table with a counting sort. mu should stay the same across appends to one pool: the
  norms of earlier tokens were computed against the mu given with them.

  Args:
    handle: the store's handle (Python int, int32 scalar array, or the HostKVStore).
    layer: static store layer index.
    slots_B: int32 store slot of each batch row (distinct within a call).
    k_BKTD, v_BKTD: post-RoPE keys and values, float32 or bfloat16.
    codes_BKTL: int32 SimHash codes of the centred keys k - mu.
    lengths_B: int32 valid tokens per row (0..T).
    mu_BKD: float32 pool mean key.

  Returns:
    int32[B]: the new pool size of each row; pass it to `store_attend` as `dep`.
  """
  h, store = _handle_operand(handle)
  layer = _check_layer(layer, store)
  slots_B, k_BKTD, v_BKTD, codes_BKTL, lengths_B, mu_BKD = map(
      jnp.asarray, (slots_B, k_BKTD, v_BKTD, codes_BKTL, lengths_B, mu_BKD))
  if k_BKTD.ndim != 4:
    raise ValueError(f"k must be [batch, kv_heads, tokens, head_dim], got shape {k_BKTD.shape}.")
  B, K, T, D = k_BKTD.shape
  _check_float("k", k_BKTD)
  _check_float("v", v_BKTD)
  _check_shape("v", v_BKTD, k_BKTD.shape, "the shape of k")
  _check_shape("slots", slots_B, (B,), "one slot per batch row")
  _check_shape("lengths", lengths_B, (B,), "one length per batch row")
  _check_shape("mu", mu_BKD, (B, K, D), "[batch, kv_heads, head_dim]")
  if codes_BKTL.ndim != 4 or tuple(codes_BKTL.shape[:3]) != (B, K, T):
    raise ValueError(f"codes has shape {tuple(codes_BKTL.shape)} but expected "
                     f"{(B, K, T)} + (num_tables,).")
  if store is not None:
    _check_shape("k", k_BKTD, (B, store.num_kv_heads, T, store.head_dim),
                 "[batch, num_kv_heads, tokens, head_dim] of the store")
    _check_shape("codes", codes_BKTL, (B, K, T, store.code_columns),
                 "one code per table; none for a proxy store")
  call = jax.ffi.ffi_call("pigjax_insert", jax.ShapeDtypeStruct((B,), jnp.int32),
                          has_side_effect=True)
  return call(h, slots_B.astype(jnp.int32), k_BKTD, v_BKTD, codes_BKTL.astype(jnp.int32),
              lengths_B.astype(jnp.int32), mu_BKD.astype(jnp.float32), layer=np.int32(layer))


def store_attend(handle, layer: int, slots_B, q_BHD, q_codes_BHL,
                 dep) -> tuple[jax.Array, jax.Array, jax.Array]:
  """LSH-sampled attention of each query over its slot's pool (docs/design.md, "The algorithm",
  steps 5-8).

  Query head h uses kv head h // (H / K). Candidates: pool tokens sharing the query's code in at
  least 2 tables; scores s_i = q.k_i / sqrt(D) - log u_i (u_i: the probability of that collision
  given the angle between q and k_i - mu).

  Args:
    handle: the store's handle. layer: static store layer index.
    slots_B: int32 store slot of each batch row.
    q_BHD: post-RoPE queries, float32 or bfloat16.
    q_codes_BHL: int32 SimHash codes of the (uncentred) queries.
    dep: any array this call must run after (e.g. `store_insert`'s result).

  Returns:
    o_BHD f32 (0 where no candidate), lse_BH f32 (-inf where no candidate), count_BH int32.
  """
  h, store = _handle_operand(handle)
  layer = _check_layer(layer, store)
  slots_B, q_BHD, q_codes_BHL, dep = map(jnp.asarray, (slots_B, q_BHD, q_codes_BHL, dep))
  if q_BHD.ndim != 3:
    raise ValueError(f"q must be [batch, q_heads, head_dim], got shape {q_BHD.shape}.")
  B, H, D = q_BHD.shape
  _check_float("q", q_BHD)
  _check_shape("slots", slots_B, (B,), "one slot per batch row")
  if q_codes_BHL.ndim != 3 or tuple(q_codes_BHL.shape[:2]) != (B, H):
    raise ValueError(f"q_codes has shape {tuple(q_codes_BHL.shape)} but expected "
                     f"{(B, H)} + (num_tables,).")
  if store is not None:
    if D != store.head_dim or H % store.num_kv_heads:
      raise ValueError(f"q has shape {tuple(q_BHD.shape)} but the store needs head_dim "
                       f"{store.head_dim} and a multiple of {store.num_kv_heads} query heads.")
    _check_shape("q_codes", q_codes_BHL, (B, H, store.code_columns),
                 "one code per table; none for a proxy store")
  out = (jax.ShapeDtypeStruct((B, H, D), jnp.float32), jax.ShapeDtypeStruct((B, H), jnp.float32),
         jax.ShapeDtypeStruct((B, H), jnp.int32))
  # No side-effect flag: the attend only reads the store, its order after an insert comes from
  # `dep`, and an effect would take the whole program off jax's C++ dispatch path (with ~500
  # operand leaves per decode step, the Python path cost about 10 ms per SmolLM2 step). Calls
  # with empty results keep it, or XLA would skip them and the handler's checks with them (a
  # closed handle, zero query heads). Handler errors surface as jax.errors.JaxRuntimeError or,
  # from the C++ dispatch path, as ValueError; the message is the same.
  call = jax.ffi.ffi_call("pigjax_attend", out, has_side_effect=B * H == 0)
  o, lse, count = call(h, slots_B.astype(jnp.int32), q_BHD, q_codes_BHL.astype(jnp.int32), dep,
                       layer=np.int32(layer))
  return o, lse, count
