"""Weight-quantized linear layers for the decode step (docs/design.md, "Quantized weights").

XLA:CPU has no fast int8 x float32 dot, so a decode step that reads quantized weights calls the
extension's `pigjax_quant_matmul` FFI handler (xla_ffi/quant.h). Weights stay in llama.cpp's
32-element block formats (Q8_0, Q4_0, Q4_1; byte-identical to GGUF, so a GGUF's own tensors are
used as stored); the activation rows are quantized once per call to int8 blocks, with an optional
second int8 "remainder" per element (`act_bits=16`, held with the code as one int16) that makes
the block products as exact as the float32 product with the dequantized weights, at no extra
cost in the kernel.

`QTensor` is a weight in blocks (a pytree: the bytes are the leaf, the format and shape static).
`pack` reorders a weight's blocks into the kernel's packed layout (rows in groups of four, each
block of a group stored as the four rows' scales and then their codes; xla_ffi/quant.h), which
the model uses: the kernel then reads one stream per thread and loads four scales at once.
`matmul` is the FFI call; `matmul_reference` is its pure-jnp twin, which performs the same integer
block products, so the two agree to float32 summation order.

Shape key:  M activation rows   K input features   N output features   R bytes per weight row
"""

from __future__ import annotations

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from pigjax import _ffi  # noqa: F401  (registers the FFI targets)

BLOCK = 32
# Format name -> (FFI format code, bytes per block, gguf type).
FORMATS = {
    "q8_0": (0, 34, gguf.GGMLQuantizationType.Q8_0),
    "q4_0": (1, 18, gguf.GGMLQuantizationType.Q4_0),
    "q4_1": (2, 20, gguf.GGMLQuantizationType.Q4_1),
}
_BY_GGUF_TYPE = {t: name for name, (_, _, t) in FORMATS.items()}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QTensor:
  """A [N, K] weight (y = x @ W.T) as N rows of K / 32 blocks.

  blocks_NR: uint8 [N, K / 32 * bytes per block].
  act_bits: how the kernel quantizes the activations it multiplies this weight with: 16 (two
    int8 bytes per element: the result equals the float32 product with the dequantized weight to
    about 1e-5) or 8 (one byte, llama.cpp's rounding: as fast on AVX2, errors of about 1%
    of the output's scale).
  packed: blocks_NR holds the packed layout (`pack`), the same bytes reordered.
  """
  blocks_NR: jax.Array
  fmt: str = dataclasses.field(metadata=dict(static=True))
  k: int = dataclasses.field(metadata=dict(static=True))
  act_bits: int = dataclasses.field(default=16, metadata=dict(static=True))
  packed: bool = dataclasses.field(default=False, metadata=dict(static=True))

  def __post_init__(self):
    _check_format(self.fmt)
    if self.act_bits not in (8, 16):
      raise ValueError(f"act_bits must be 8 or 16, got {self.act_bits!r}.")

  @property
  def n(self) -> int:
    return self.blocks_NR.shape[0]

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.blocks_NR.shape))


def _check_format(fmt: str) -> None:
  if fmt not in FORMATS:
    raise ValueError(f"Unknown weight block format {fmt!r}; use one of {sorted(FORMATS)}.")


def quantize(w_NK: np.ndarray, fmt: str, act_bits: int = 16) -> QTensor:
  """Quantizes a float [N, K] weight (K a multiple of 32) with ggml's reference rounding."""
  _check_format(fmt)
  w_NK = np.asarray(w_NK, np.float32)
  if w_NK.ndim != 2 or w_NK.shape[1] % BLOCK:
    raise ValueError(f"Can only quantize [N, K] weights with K a multiple of {BLOCK}; got shape "
                     f"{w_NK.shape}.")
  blocks = gguf.quants.quantize(w_NK, FORMATS[fmt][2])
  return QTensor(jnp.asarray(blocks), fmt, w_NK.shape[1], act_bits)


def from_gguf_blocks(blocks_NR: np.ndarray, gguf_type, k: int,
                     act_bits: int = 16) -> QTensor | None:
  """A GGUF tensor's raw [N, R] block bytes as a QTensor, or None if its format is not one the
  kernel reads (the caller then re-quantizes the dequantized weight)."""
  fmt = _BY_GGUF_TYPE.get(gguf_type)
  if fmt is None:
    return None
  blocks_NR = np.ascontiguousarray(blocks_NR, np.uint8)
  if blocks_NR.shape[1] != k // BLOCK * FORMATS[fmt][1]:
    raise ValueError(f"A {fmt} tensor with {k} columns needs {k // BLOCK * FORMATS[fmt][1]} bytes "
                     f"per row, got {blocks_NR.shape[1]}.")
  return QTensor(jnp.asarray(blocks_NR), fmt, k, act_bits)


PACK_ROWS = 4  # rows per group of the packed layout


def pack(w: QTensor) -> QTensor:
  """The packed layout of `w` (N a multiple of 4): for each group of four rows and each block,
  the four rows' f16 scales d (then, for Q4_1, their f16 minimums m), then their codes."""
  if w.packed:
    return w
  if w.n % PACK_ROWS:
    raise ValueError(f"The packed layout needs a multiple of {PACK_ROWS} rows, got {w.n}.")
  nb, nbytes = w.k // BLOCK, FORMATS[w.fmt][1]
  head = _header_bytes(w.fmt)
  blk = w.blocks_NR.reshape(w.n // PACK_ROWS, PACK_ROWS, nb, nbytes).transpose(0, 2, 1, 3)
  # [G, nb, row, field, byte] -> [G, nb, field, row, byte]: d of the four rows, then m.
  hdr = blk[..., :head].reshape(*blk.shape[:3], head // 2, 2).transpose(0, 1, 3, 2, 4)
  codes = blk[..., head:]
  x4 = jnp.concatenate([hdr.reshape(*blk.shape[:2], -1), codes.reshape(*blk.shape[:2], -1)], -1)
  return dataclasses.replace(w, blocks_NR=x4.reshape(w.n, -1), packed=True)


def unpack(w: QTensor) -> QTensor:
  """The GGUF layout of a packed weight (`pack`'s inverse)."""
  if not w.packed:
    return w
  nb, nbytes = w.k // BLOCK, FORMATS[w.fmt][1]
  head, groups = _header_bytes(w.fmt), w.n // PACK_ROWS
  x4 = w.blocks_NR.reshape(groups, nb, PACK_ROWS * nbytes)
  hdr = x4[..., :PACK_ROWS * head].reshape(groups, nb, head // 2, PACK_ROWS, 2)
  hdr = hdr.transpose(0, 1, 3, 2, 4).reshape(groups, nb, PACK_ROWS, head)
  codes = x4[..., PACK_ROWS * head:].reshape(groups, nb, PACK_ROWS, nbytes - head)
  blk = jnp.concatenate([hdr, codes], -1).transpose(0, 2, 1, 3)
  return dataclasses.replace(w, blocks_NR=blk.reshape(w.n, -1), packed=False)


def _header_bytes(fmt: str) -> int:
  """Bytes of a block before its codes: f16 d, and f16 m for Q4_1."""
  return 4 if fmt == "q4_1" else 2


def concat_rows(tensors: list[QTensor]) -> QTensor:
  """Stacks weights with the same format and K along N (e.g. q, k, v into one matmul)."""
  tensors = [unpack(t) for t in tensors]
  kinds = {(t.fmt, t.k, t.act_bits) for t in tensors}
  if len(kinds) != 1:
    raise ValueError(f"Can only concatenate weights of one format, K and act_bits; got {kinds}.")
  fmt, k, act_bits = kinds.pop()
  return QTensor(jnp.concatenate([t.blocks_NR for t in tensors], 0), fmt, k, act_bits)


def dequantize(w: QTensor) -> jax.Array:
  """float32 [N, K] values of the blocks (pure jnp)."""
  w = unpack(w)
  N, nb = w.n, w.k // BLOCK
  blk = w.blocks_NR.reshape(N, nb, -1)
  d = _half(blk[..., 0:2])
  body = blk[..., _header_bytes(w.fmt):]  # the codes: int8 (Q8_0) or nibble pairs
  if w.fmt == "q8_0":
    codes = jax.lax.bitcast_convert_type(body, jnp.int8).astype(jnp.float32)
    return (d[..., None] * codes).reshape(N, w.k)
  codes = jnp.concatenate([body & 0xF, body >> 4], -1).astype(jnp.float32)
  if w.fmt == "q4_1":
    return (d[..., None] * codes + _half(blk[..., 2:4])[..., None]).reshape(N, w.k)
  return (d[..., None] * (codes - 8.0)).reshape(N, w.k)


def _half(b_2: jax.Array) -> jax.Array:
  """Little-endian float16 from [..., 2] bytes, as float32."""
  u16 = b_2[..., 0].astype(jnp.uint16) | (b_2[..., 1].astype(jnp.uint16) << 8)
  return jax.lax.bitcast_convert_type(u16, jnp.float16).astype(jnp.float32)


def quantize_activations(x_MK: jax.Array, act_bits: int = 16):
  """The kernel's activation blocks, x ~ d (256 q + r) (xla_ffi/quant.h `ActBlock`).

  Returns q, r int8 [M, K/32, 32] (r = 0 for act_bits=8), d and the exact block sums s
  [M, K/32], all computed the way the kernel computes them (rounding half to even).
  """
  M, K = x_MK.shape
  xb = x_MK.astype(jnp.float32).reshape(M, K // BLOCK, BLOCK)
  d = jnp.max(jnp.abs(xb), -1) / 127.0
  inv = jnp.where(d != 0, 1.0 / jnp.where(d != 0, d, 1.0), 0.0)
  scaled = xb * inv[..., None]
  q = jnp.round(scaled)
  r = jnp.clip(jnp.round((scaled - q) * 256.0), -127, 127)
  if act_bits == 8:
    r = jnp.zeros_like(r)
  return q.astype(jnp.int8), r.astype(jnp.int8), d / 256.0, jnp.sum(xb, -1)


def matmul_reference(x_MK: jax.Array, w: QTensor) -> jax.Array:
  """Pure-jnp twin of `matmul`: the same activation blocks and integer block products."""
  q, r, d_x, s_x = quantize_activations(x_MK, w.act_bits)
  w = unpack(w)
  N, nb = w.n, w.k // BLOCK
  blk = w.blocks_NR.reshape(N, nb, -1)
  d_w = _half(blk[..., 0:2])
  body = blk[..., _header_bytes(w.fmt):]  # the codes: int8 (Q8_0) or nibble pairs
  if w.fmt == "q8_0":
    codes = jax.lax.bitcast_convert_type(body, jnp.int8).astype(jnp.int32)
    c_w = jnp.zeros_like(d_w)
  else:
    # Centred codes, as the kernel uses (xla_ffi/quant.h UnpackScalar): w = d (nib - 8) + c.
    codes = jnp.concatenate([body & 0xF, body >> 4], -1).astype(jnp.int32) - 8
    c_w = _half(blk[..., 2:4]) + 8.0 * d_w if w.fmt == "q4_1" else jnp.zeros_like(d_w)
  x_int = 256 * q.astype(jnp.int32) + r.astype(jnp.int32)
  dots_MNB = jnp.einsum("mbj,nbj->mnb", x_int, codes)
  return (jnp.einsum("mnb,mb,nb->mn", dots_MNB.astype(jnp.float32), d_x, d_w)
          + jnp.einsum("mb,nb->mn", s_x, c_w))


def matmul(x_MK: jax.Array, w: QTensor) -> jax.Array:
  """float32 [M, N] = x @ W.T through the FFI kernel (x is cast to float32; see
  `QTensor.act_bits` for how it is quantized)."""
  if x_MK.ndim != 2 or x_MK.shape[1] != w.k:
    raise ValueError(f"quant.matmul: x must be [M, {w.k}], got {x_MK.shape}.")
  out = jax.ShapeDtypeStruct((x_MK.shape[0], w.n), jnp.float32)
  return jax.ffi.ffi_call("pigjax_quant_matmul", out)(
      x_MK.astype(jnp.float32), w.blocks_NR, format=np.int32(FORMATS[w.fmt][0]),
      act_bits=np.int32(w.act_bits), packed=np.int32(w.packed))


def linear(x_BTE: jax.Array, w: QTensor) -> jax.Array:
  """x @ W.T over the last axis of a [..., K] activation -> float32 [..., N]."""
  lead = x_BTE.shape[:-1]
  return matmul(x_BTE.reshape(-1, x_BTE.shape[-1]), w).reshape(*lead, w.n)
