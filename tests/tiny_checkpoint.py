"""Writes tiny random Hugging Face Llama checkpoints (config.json + sharded safetensors) for tests.

Uses only `safetensors.numpy` (no torch); bf16 arrays are `ml_dtypes.bfloat16`, which
safetensors writes as BF16.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors.numpy


def tiny_llama_tensors(*, num_layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
                       intermediate=128, vocab=300, tie=False, seed=0) -> dict[str, np.ndarray]:
  """Random float32 tensors with Hugging Face Llama names and [out, in] shapes."""
  rng = np.random.default_rng(seed)

  def lin(out, inp):
    return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

  def norm():
    return (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

  t = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden)).astype(np.float32)}
  for i in range(num_layers):
    p = f"model.layers.{i}."
    t[p + "input_layernorm.weight"] = norm()
    t[p + "self_attn.q_proj.weight"] = lin(heads * head_dim, hidden)
    t[p + "self_attn.k_proj.weight"] = lin(kv_heads * head_dim, hidden)
    t[p + "self_attn.v_proj.weight"] = lin(kv_heads * head_dim, hidden)
    t[p + "self_attn.o_proj.weight"] = lin(hidden, heads * head_dim)
    t[p + "post_attention_layernorm.weight"] = norm()
    t[p + "mlp.gate_proj.weight"] = lin(intermediate, hidden)
    t[p + "mlp.up_proj.weight"] = lin(intermediate, hidden)
    t[p + "mlp.down_proj.weight"] = lin(hidden, intermediate)
  t["model.norm.weight"] = norm()
  if not tie:
    t["lm_head.weight"] = lin(vocab, hidden)
  return t


def write_tiny_llama(directory, *, num_layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
                     intermediate=128, vocab=300, tie=False, rope_scaling=None, rope_theta=10000.0,
                     max_position=512, dtype="float32", shards=2, seed=0,
                     config_overrides=None) -> dict[str, np.ndarray]:
  """Writes a random Llama checkpoint directory and returns the tensors written.

  Args:
    directory: created if missing.
    rope_scaling: written verbatim as config.json's rope_scaling, e.g.
      {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
       "original_max_position_embeddings": 256}.
    dtype: "float32" | "bfloat16" storage dtype.
    shards: number of safetensors files; > 1 also writes model.safetensors.index.json.
    config_overrides: extra / replaced config.json keys (for error tests).
  Returns:
    {HF name: array} exactly as stored (float32 or ml_dtypes.bfloat16).
  """
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
  tensors = {n: a.astype(np_dtype) for n, a in tiny_llama_tensors(
      num_layers=num_layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
      intermediate=intermediate, vocab=vocab, tie=tie, seed=seed).items()}
  config = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "hidden_size": hidden, "intermediate_size": intermediate,
      "num_hidden_layers": num_layers, "num_attention_heads": heads,
      "num_key_value_heads": kv_heads, "head_dim": head_dim, "hidden_act": "silu",
      "rms_norm_eps": 1e-5, "rope_theta": rope_theta, "rope_scaling": rope_scaling,
      "max_position_embeddings": max_position, "tie_word_embeddings": tie,
      "vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2,
      "attention_bias": False, "mlp_bias": False,
      "torch_dtype": dtype,
  } | (config_overrides or {})
  (directory / "config.json").write_text(json.dumps(config, indent=1))
  write_tiny_tokenizer(directory)

  names = list(tensors)
  if shards <= 1:
    safetensors.numpy.save_file(tensors, directory / "model.safetensors",
                                metadata={"format": "pt"})
    return tensors
  weight_map = {}
  for s, group in enumerate(np.array_split(np.arange(len(names)), shards)):
    fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = {names[i]: tensors[names[i]] for i in group}
    safetensors.numpy.save_file(part, directory / fname, metadata={"format": "pt"})
    weight_map |= dict.fromkeys(part, fname)
  index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
           "weight_map": weight_map}
  (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
  return tensors


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_tokenizer(directory) -> None:
  """A byte-level BPE over the 256 bytes (no merges) with ChatML specials at ids 0-2 shifted to
  256-258, plus tokenizer_config.json with a ChatML template: fits vocab >= 259."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from tokenizers.pre_tokenizers import ByteLevel

  alphabet = sorted(ByteLevel.alphabet())
  vocab = {ch: i for i, ch in enumerate(alphabet)}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
  directory = Path(directory)
  tok.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHATML}))
