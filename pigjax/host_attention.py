"""Dense decode attention in a host (CPU) kernel: the `pigjax_decode_attend` FFI handler.

A decode step's query against the dense cache is, in XLA:CPU, a chain of small ops per key block
(dynamic slice, matrix-vector dot on the intra-op pool, masked softmax, another dot); at 4k tokens
on SmolLM2 that chain is over half of the decode step's CPU time while the bytes it reads take
a few milliseconds. The handler (xla_ffi/decode_attention.h) reads each filled K and V row once
for all query heads of its KV head, in row chunks split over the compute thread pool, and merges
the chunks by log-sum-exp. `attention.decode_kernel` selects it ("auto": whenever the decode step
runs on the CPU).

Shape key: B batch   H query heads   K kv heads   S cache positions   D head dim
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pigjax import _ffi  # noqa: F401  (registers the FFI targets)
from pigjax import placement
from pigjax.config import DECODE_KERNELS, Config


def use_host_kernel(cfg: Config) -> bool:
  """Whether decode steps attend over the dense cache with the host kernel.

  "auto" picks it when the decode step runs on the CPU (jax's default device is the CPU, or the
  attention is MagicPIG, whose step `pigjax.placement` puts on the CPU) on one device. On a mesh
  (`pigjax.sharding`) the jnp path runs: the kernel is not wrapped in shard_map yet, and an FFI
  call outside it would see all-gathered operands.
  """
  from pigjax.sharding import mesh_requested
  a = cfg.attention
  if a.decode_kernel not in DECODE_KERNELS:
    raise ValueError(f"attention.decode_kernel must be one of {DECODE_KERNELS}, got "
                     f"{a.decode_kernel!r}.")
  on_mesh = mesh_requested(cfg.mesh)
  if a.decode_kernel == "host" and on_mesh:
    raise ValueError("attention.decode_kernel='host' runs on one device only; on a mesh use "
                     "'auto' or 'xla'.")
  if a.decode_kernel == "auto":
    return not on_mesh and placement.decode_runs_on_cpu(a.kind)
  return a.decode_kernel == "host"


def decode_attend(q_BHD: jax.Array, k_BKSD: jax.Array, v_BKSD: jax.Array,
                  lengths_B: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Softmax attention of one query per row over cache rows [0, lengths_B[b]).

  Returns o_BHD (float32; 0 for an empty row) and lse_BH (float32 log-sum-exp of the scaled
  scores; -inf for an empty row), like `attention.attend_with_lse`. K and V may be float32 or
  bfloat16; lengths are clamped to [0, S].
  """
  B, H, D = q_BHD.shape
  out = (jax.ShapeDtypeStruct((B, H, D), jnp.float32), jax.ShapeDtypeStruct((B, H), jnp.float32))
  return jax.ffi.ffi_call("pigjax_decode_attend", out)(
      q_BHD.astype(jnp.float32), k_BKSD, v_BKSD, lengths_B.astype(jnp.int32))


def decode_attend_masked(q_BHD: jax.Array, k_BKSD: jax.Array, v_BKSD: jax.Array,
                         valid_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`decode_attend` over the cache rows that valid_BS marks (any rows, not a prefix): MagicPIG's
  exact buffer (sink, window, generated tokens), whose unused entries lie between used ones.
  Same results as `attention.attend_with_lse(q[:, None], k, v, valid_BS[:, None])` at T = 1."""
  B, H, D = q_BHD.shape
  S = k_BKSD.shape[2]
  out = (jax.ShapeDtypeStruct((B, H, D), jnp.float32), jax.ShapeDtypeStruct((B, H), jnp.float32))
  return jax.ffi.ffi_call("pigjax_decode_attend_masked", out)(
      q_BHD.astype(jnp.float32), k_BKSD, v_BKSD, jnp.full((B,), S, jnp.int32),
      valid_BS.astype(jnp.int8))
