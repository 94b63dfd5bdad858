"""A Llama-family decoder (Llama 2 / 3 / 3.1, SmolLM2) in Flax NNX.

The model computes projections, norms, RoPE and MLPs; attention over the cache is delegated per
layer to an attention backend (`pigjax.attention`), so dense and MagicPIG decoding share one
model. With quantized weights attached (`attach_quantized`), decode steps (one token per row)
run every matmul through the quantized-block FFI kernel (`pigjax.quant`); prefill chunks keep the
dense weights. RoPE follows Hugging Face's rotate-half layout (GGUF weights are un-permuted on load), with
Llama-3.1 "llama3" frequency scaling.

Shape key:
  B batch   T tokens in this call   S cache positions   E hidden   V vocab   F MLP hidden
  H query heads   K kv heads   D head dim
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pigjax import quant
from pigjax.config import ModelConfig


def _param(shape, dtype, rngs: nnx.Rngs, scale: float) -> nnx.Param:
  return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype) * scale)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, dtype):
    self.scale_E = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x_BTE: jax.Array) -> jax.Array:
    x = x_BTE.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.scale_E[...].astype(jnp.float32)).astype(x_BTE.dtype)


class QuantWeight(nnx.Variable):
  """A weight in quantized blocks (a `pigjax.quant.QTensor`) for the decode step's matmuls."""


def _quant(var: QuantWeight | None, x_BTE: jax.Array) -> quant.QTensor | None:
  """The quantized weight to use for x: only in decode steps (one token per row)."""
  return var.get_value() if var is not None and x_BTE.shape[1] == 1 else None


class Block(nnx.Module):
  """One pre-norm decoder layer: attention (projections here, the rest in the backend) + SwiGLU."""

  def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
    E, H, K, D, F = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
    self.attn_norm = RMSNorm(E, cfg.rms_norm_eps, dtype)
    self.q_EHD = _param((E, H, D), dtype, rngs, E**-0.5)
    self.k_EKD = _param((E, K, D), dtype, rngs, E**-0.5)
    self.v_EKD = _param((E, K, D), dtype, rngs, E**-0.5)
    self.o_HDE = _param((H, D, E), dtype, rngs, (H * D)**-0.5)
    self.mlp_norm = RMSNorm(E, cfg.rms_norm_eps, dtype)
    self.gate_EF = _param((E, F), dtype, rngs, E**-0.5)
    self.up_EF = _param((E, F), dtype, rngs, E**-0.5)
    self.down_FE = _param((F, E), dtype, rngs, F**-0.5)
    # Quantized copies for decode (`attach_quantized`): q, k, v rows stacked into one matmul, and
    # gate, up likewise, so a step makes four kernel calls per layer.
    self.qkv_q: QuantWeight | None = None
    self.o_q: QuantWeight | None = None
    self.gate_up_q: QuantWeight | None = None
    self.down_q: QuantWeight | None = None

  def qkv(self, h_BTE: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Q, K, V projections (before RoPE): [B, T, H, D], [B, T, K, D], [B, T, K, D]."""
    w = _quant(self.qkv_q, h_BTE)
    if w is None:
      return (_project(h_BTE, self.q_EHD[...]), _project(h_BTE, self.k_EKD[...]),
              _project(h_BTE, self.v_EKD[...]))
    _, H, D = self.q_EHD.shape
    K = self.k_EKD.shape[1]
    qkv_BTN = quant.linear(h_BTE, w).astype(h_BTE.dtype)
    q, k, v = jnp.split(qkv_BTN, [H * D, (H + K) * D], axis=-1)
    B, T = h_BTE.shape[:2]
    return q.reshape(B, T, H, D), k.reshape(B, T, K, D), v.reshape(B, T, K, D)

  def out(self, out_BTHD: jax.Array, dtype) -> jax.Array:
    """The output projection of the attention heads -> [B, T, E]."""
    B, T, H, D = out_BTHD.shape
    o_BTN = out_BTHD.astype(dtype).reshape(B, T, H * D)
    w = _quant(self.o_q, o_BTN)
    if w is not None:
      return quant.linear(o_BTN, w).astype(dtype)
    # Contract over heads x head_dim as one 2-D matmul: XLA would otherwise transpose the
    # [H, D, E] weight on every call.
    return jnp.einsum("btn,ne->bte", o_BTN, self.o_HDE[...].reshape(H * D, -1))

  def mlp(self, x_BTE: jax.Array) -> jax.Array:
    h = self.mlp_norm(x_BTE)
    w = _quant(self.gate_up_q, h)
    if w is not None:
      gate_BTF, up_BTF = jnp.split(quant.linear(h, w).astype(h.dtype), 2, axis=-1)
      return quant.linear(jax.nn.silu(gate_BTF) * up_BTF, self.down_q.get_value()).astype(h.dtype)
    gate_BTF = jnp.einsum("bte,ef->btf", h, self.gate_EF[...])
    up_BTF = jnp.einsum("bte,ef->btf", h, self.up_EF[...])
    return jnp.einsum("btf,fe->bte", jax.nn.silu(gate_BTF) * up_BTF, self.down_FE[...])


class Llama(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.cfg = cfg
    self.dtype = dtype
    self.embed_VE = _param((cfg.vocab_size, cfg.hidden_size), dtype, rngs, 1.0)
    self.layers = nnx.List([Block(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
    self.lm_head_EV = (None if cfg.tie_embeddings else
                       _param((cfg.hidden_size, cfg.vocab_size), dtype, rngs,
                              cfg.hidden_size**-0.5))
    self.lm_head_q: QuantWeight | None = None  # [V, E] rows (the embedding when tied)

  def logits(self, x_BTE: jax.Array) -> jax.Array:
    """Final norm + LM head; float32 logits."""
    h = self.final_norm(x_BTE)
    w = _quant(self.lm_head_q, h)
    if w is not None:
      return quant.linear(h, w)
    if self.lm_head_EV is None:
      return jnp.einsum("bte,ve->btv", h, self.embed_VE[...], preferred_element_type=jnp.float32)
    return jnp.einsum("bte,ev->btv", h, self.lm_head_EV[...], preferred_element_type=jnp.float32)

  def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array, attend: Callable,
               cache: Any) -> tuple[jax.Array, Any]:
    """Runs the decoder body and returns the final hidden states (before the norm).

    Args:
      tokens_BT: int32 token ids.
      positions_BT: int32 absolute positions (RoPE and causal masking).
      attend: `attend(layer, q_BTHD, k_BTKD, v_BTKD, cache) -> (out_BTHD, cache)`; it owns the
        cache (writes the new keys/values and attends over everything visible).
      cache: the backend's cache pytree.
    Returns:
      (hidden_BTE, cache).
    """
    cfg = self.cfg
    x_BTE = jnp.take(self.embed_VE[...], tokens_BT, axis=0)
    sin_BTD, cos_BTD = rope_tables(positions_BT, cfg)
    for layer, blk in enumerate(self.layers):
      q_BTHD, k_BTKD, v_BTKD = blk.qkv(blk.attn_norm(x_BTE))
      q_BTHD = apply_rope(q_BTHD, sin_BTD, cos_BTD)
      k_BTKD = apply_rope(k_BTKD, sin_BTD, cos_BTD)
      out_BTHD, cache = attend(layer, q_BTHD, k_BTKD, v_BTKD, cache)
      x_BTE = x_BTE + blk.out(out_BTHD, x_BTE.dtype)
      x_BTE = x_BTE + blk.mlp(x_BTE)
    return x_BTE, cache


def _project(x_BTE: jax.Array, w_END: jax.Array) -> jax.Array:
  """x @ w for a [E, heads, D] weight, as a 2-D matmul (no weight transpose); -> [B, T, heads, D]."""
  E, N, D = w_END.shape
  return jnp.einsum("bte,en->btn", x_BTE, w_END.reshape(E, N * D)).reshape(*x_BTE.shape[:2], N, D)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Inverse frequencies [D/2], with Llama-3.1 "llama3" scaling when configured."""
  D = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta**(np.arange(0, D, 2, dtype=np.float64) / D))
  if cfg.rope_scaling_factor:
    # transformers' _compute_llama3_parameters: long wavelengths are divided by the factor, short
    # ones kept, and the band between is interpolated smoothly.
    factor, lo, hi = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_ctx = cfg.rope_original_max_position
    low_freq_wavelen, high_freq_wavelen = old_ctx / lo, old_ctx / hi
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    inv_freq = np.where(medium, smoothed, scaled)
  return inv_freq.astype(np.float32)


def rope_tables(positions_BT: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
  inv_freq = jnp.asarray(rope_inv_freq(cfg))
  angles = positions_BT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.sin(angles), jnp.cos(angles)


def apply_rope(x_BTND: jax.Array, sin_BTD: jax.Array, cos_BTD: jax.Array) -> jax.Array:
  """Rotate-half RoPE (Hugging Face layout) on [B, T, heads, D]; computed in float32."""
  x = x_BTND.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  out = x * cos_BTD[:, :, None, :] + rotated * sin_BTD[:, :, None, :]
  return out.astype(x_BTND.dtype)


def from_hf_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray], dtype=jnp.float32) -> Llama:
  """Builds a `Llama` from Hugging Face-named tensors ([out, in] Linear weights)."""
  model = nnx.eval_shape(lambda: Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
  E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

  def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
      raise ValueError(f"Checkpoint is missing tensor {name!r}.")
    w = tensors[name]
    if tuple(w.shape) != shape:
      raise ValueError(f"Tensor {name!r} has shape {tuple(w.shape)}, expected {shape} for this "
                       "config.")
    return w

  def put(var: nnx.Param, value: np.ndarray) -> None:
    var.set_value(jnp.asarray(np.asarray(value, dtype=np.float32), dtype=dtype))

  put(model.embed_VE, get("model.embed_tokens.weight", (cfg.vocab_size, E)))
  put(model.final_norm.scale_E, get("model.norm.weight", (E,)))
  if model.lm_head_EV is not None:
    put(model.lm_head_EV, get("lm_head.weight", (cfg.vocab_size, E)).T)
  for i, blk in enumerate(model.layers):
    p = f"model.layers.{i}."
    put(blk.attn_norm.scale_E, get(p + "input_layernorm.weight", (E,)))
    put(blk.mlp_norm.scale_E, get(p + "post_attention_layernorm.weight", (E,)))
    put(blk.q_EHD, get(p + "self_attn.q_proj.weight", (H * D, E)).T.reshape(E, H, D))
    put(blk.k_EKD, get(p + "self_attn.k_proj.weight", (K * D, E)).T.reshape(E, K, D))
    put(blk.v_EKD, get(p + "self_attn.v_proj.weight", (K * D, E)).T.reshape(E, K, D))
    put(blk.o_HDE, get(p + "self_attn.o_proj.weight", (E, H * D)).T.reshape(H, D, E))
    F = cfg.intermediate_size
    put(blk.gate_EF, get(p + "mlp.gate_proj.weight", (F, E)).T)
    put(blk.up_EF, get(p + "mlp.up_proj.weight", (F, E)).T)
    put(blk.down_FE, get(p + "mlp.down_proj.weight", (E, F)).T)
  return model


# Weight formats a config may ask for (`Config.weights`); see `attach_quantized`.
WEIGHT_FORMATS = ("auto", "dense", "gguf", *quant.FORMATS)


def attach_quantized(model: Llama, tensors: dict[str, np.ndarray], fmt: str,
                     blocks: dict[str, tuple[np.ndarray, Any]] | None = None,
                     act_bits: int = 16) -> int:
  """Gives every decode matmul of `model` a quantized weight; returns the bytes they take.

  Args:
    model: the model (its dense weights stay, for prefill).
    tensors: Hugging Face-named float weights ([out, in]), as `from_hf_tensors` takes.
    fmt: "q8_0" | "q4_0" | "q4_1" to quantize every weight to that format, or "gguf" to use
      `blocks` (a GGUF's own tensors, `weights.gguf_blocks`) where the kernel reads their format,
      and Q8_0 for any other tensor.
    blocks: {HF name: (uint8 [out, bytes per row], gguf type)} for fmt "gguf".
    act_bits: activation precision of the kernel (`pigjax.quant.QTensor.act_bits`).
  """
  if fmt not in quant.FORMATS and fmt != "gguf":
    raise ValueError(f"Quantized weight format must be one of {sorted(quant.FORMATS)} or 'gguf', "
                     f"got {fmt!r}.")
  blocks = blocks or {}

  def group(names: list[str]) -> quant.QTensor:
    """The weights of `names` stacked along their rows, in one format."""
    if fmt == "gguf":
      found = [quant.from_gguf_blocks(*blocks[n], tensors[n].shape[1], act_bits)
               if n in blocks else None for n in names]
      if all(t is not None for t in found) and len({t.fmt for t in found}) == 1:
        return quant.concat_rows(found)
    target = "q8_0" if fmt == "gguf" else fmt  # GGUF formats the kernel cannot read, or mixed
    return quant.quantize(np.concatenate([tensors[n] for n in names], 0), target, act_bits)

  def packed(w: quant.QTensor) -> quant.QTensor:
    """The kernel's packed layout where the row count allows (xla_ffi/quant.h)."""
    return quant.pack(w) if w.n % quant.PACK_ROWS == 0 else w

  total = 0
  for i, blk in enumerate(model.layers):
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    for attr, names in (("qkv_q", [attn + "q_proj.weight", attn + "k_proj.weight",
                                    attn + "v_proj.weight"]),
                        ("o_q", [attn + "o_proj.weight"]),
                        ("gate_up_q", [mlp + "gate_proj.weight", mlp + "up_proj.weight"]),
                        ("down_q", [mlp + "down_proj.weight"])):
      w = packed(group(names))
      total += w.nbytes
      setattr(blk, attr, nnx.data(QuantWeight(w)))
  head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
  w = packed(group([head]))
  model.lm_head_q = nnx.data(QuantWeight(w))
  return total + w.nbytes
