"""The public entry point: load a checkpoint + tokenizer, pick the attention backend, generate text.

    cfg = pigjax.config.Config(checkpoint="smollm2")
    pipe = Pipeline.load(cfg)
    results, stats = pipe.generate(["What is the capital of France?"], chat=True)
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable, Sequence

import jax.numpy as jnp

from pigjax import placement, sampling, sharding, weights
from pigjax.config import AttentionConfig, Config, SamplingConfig, validate_attention
from pigjax.engine import Engine, GenerationResult, GenerationStats
from pigjax.model import WEIGHT_FORMATS, Llama, attach_quantized, from_hf_tensors
from pigjax.step import make_backend
from pigjax.tokenizer import Tokenizer

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _gguf_path(spec: str) -> Path | None:
  if spec == "smollm2":
    return weights.smollm2_gguf_path()
  path = Path(spec).expanduser()
  return path if path.is_file() else None


def load_tokenizer(spec: str) -> Tokenizer:
  """The tokenizer that belongs to a checkpoint spec (see `weights.load_checkpoint`)."""
  gguf_path = _gguf_path(spec)
  if gguf_path is not None:
    return Tokenizer.from_gguf(gguf_path)
  path = Path(spec).expanduser()
  if not path.exists():
    raise FileNotFoundError(f"Checkpoint {spec!r} does not exist.")
  return Tokenizer.from_hf_dir(path)  # HF directories and Orbax checkpoints written by pigjax


def _is_gguf(spec: str) -> bool:
  path = _gguf_path(spec)
  return path is not None and path.suffix == ".gguf"


def load_model_and_tokenizer(spec: str, progress: bool = True,
                             tokenizer: Tokenizer | None = None, blocks: bool = False):
  """(ModelConfig, HF-named tensors, Tokenizer, GGUF blocks); a GGUF's header is parsed once.

  A `tokenizer` already built from the same spec (to check prompts before the weights load) is
  returned as is rather than built again. The last item is `weights.gguf_blocks` of a GGUF
  checkpoint when `blocks` is set, else {}.
  """
  if _is_gguf(spec):
    import gguf
    gguf_path = _gguf_path(spec)
    try:
      reader = gguf.GGUFReader(gguf_path)
    except Exception as e:
      raise ValueError(f"{gguf_path} is not a readable GGUF file ({e}).") from e
    model_cfg, tensors = weights.load_gguf(reader, progress=progress)
    raw = weights.gguf_blocks(reader, model_cfg) if blocks else {}
    return model_cfg, tensors, tokenizer or Tokenizer.from_gguf(reader), raw
  tokenizer = tokenizer or load_tokenizer(spec)
  model_cfg, tensors, _ = weights.load_checkpoint(spec, progress=progress)
  return model_cfg, tensors, tokenizer, {}


def resolve_weights(cfg: Config) -> str:
  """The decode-step weight format `cfg.weights` stands for: "auto" is a GGUF checkpoint's own
  blocks ("gguf") when the decode step runs on the CPU (the quantized kernel is a CPU FFI
  handler) and dense weights otherwise (another checkpoint, or an accelerator)."""
  if sharding.mesh_requested(cfg.mesh):
    # The quantized matmul is one FFI call with no partitioning rule: under a mesh its operands
    # would be gathered onto every device. Sharded decode runs dense weights.
    if cfg.weights not in ("auto", "dense"):
      raise ValueError(f"weights={cfg.weights!r} is not supported on a device mesh (mesh.data x "
                       f"mesh.model = {cfg.mesh.data} x {cfg.mesh.model}, or several processes); "
                       "use --config.weights=dense (auto picks dense there).")
    return "dense"
  if cfg.weights == "auto":
    on_cpu = placement.decode_runs_on_cpu(cfg.attention.kind)
    return "gguf" if _is_gguf(cfg.checkpoint) and on_cpu else "dense"
  if cfg.weights != "dense" and not placement.decode_runs_on_cpu(cfg.attention.kind):
    raise ValueError(f"weights={cfg.weights!r} runs the decode matmuls in a CPU kernel, but jax's "
                     "default device is not the CPU; use --config.weights=dense (or auto) there.")
  if cfg.weights == "gguf" and not _is_gguf(cfg.checkpoint):
    raise ValueError(f"weights='gguf' needs a GGUF checkpoint; {cfg.checkpoint!r} is not one. Use "
                     f"'q8_0', 'q4_0', 'q4_1' or 'dense'.")
  return cfg.weights


def encode_prompt(tokenizer: Tokenizer, prompt: str, chat: bool = False,
                  system: str | None = None) -> list[int]:
  """Prompt ids; with `chat`, rendered through the checkpoint's chat template first."""
  if chat:
    messages = ([{"role": "system", "content": system}] if system else [])
    messages.append({"role": "user", "content": prompt})
    return tokenizer.encode(tokenizer.apply_chat_template(messages))
  return tokenizer.encode(prompt)


def check_prompt_lengths(ids: Sequence[Sequence[int]], max_new_tokens: int, max_seq_len: int,
                         max_position: int | None = None) -> None:
  """Raises ValueError for an empty prompt or one with no room for max_new_tokens.

  Cheap: the CLI calls it after tokenising and before the weights load (max_position is then
  not known yet; the engine checks it again).
  """
  limit, what = max_seq_len, f"config max_seq_len={max_seq_len}"
  if max_position is not None and max_position < max_seq_len:
    limit, what = max_position, f"the model's max_position={max_position}"
  for i, p in enumerate(ids):
    if not p:
      raise ValueError(f"Prompt {i} is empty (0 tokens); give at least one token of text.")
    if len(p) + max_new_tokens > limit:
      raise ValueError(
          f"Prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
          f"{len(p) + max_new_tokens} positions, above the context limit of {limit} tokens "
          f"({what}); shorten the prompt or lower max_new_tokens.")


def validate(cfg: Config) -> None:
  """Cheap checks that run before any weight is read."""
  if not cfg.checkpoint:
    raise ValueError("config.checkpoint is empty: set --config.checkpoint to 'smollm2', a .gguf "
                     "file, a Hugging Face Llama directory or a pigjax Orbax checkpoint.")
  if cfg.dtype not in _DTYPES:
    raise ValueError(f"Unknown dtype {cfg.dtype!r}; use one of {sorted(_DTYPES)}.")
  if cfg.cache_dtype != "auto" and cfg.cache_dtype not in _DTYPES:
    raise ValueError(f"Unknown cache_dtype {cfg.cache_dtype!r}; use 'auto' or one of "
                     f"{sorted(_DTYPES)}.")
  validate_attention(cfg.attention)
  if cfg.weights not in WEIGHT_FORMATS:
    raise ValueError(f"Unknown weights {cfg.weights!r}; use one of {list(WEIGHT_FORMATS)}.")
  if cfg.act_bits not in (8, 16):
    raise ValueError(f"act_bits must be 8 or 16, got {cfg.act_bits!r}.")
  if cfg.max_seq_len < 2:
    raise ValueError(f"max_seq_len={cfg.max_seq_len} is too small: it is the cache capacity per "
                     "sequence (prompt + generated tokens) and must be at least 2.")
  if cfg.prefill_chunk < 1:
    raise ValueError(f"prefill_chunk must be at least 1 token, got {cfg.prefill_chunk}.")
  sharding.validate_mesh(cfg.mesh)
  s = cfg.sampling
  sampling.validate_sampling(s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty,
                             s.max_new_tokens)


@dataclasses.dataclass
class Pipeline:
  cfg: Config
  model: Llama
  tokenizer: Tokenizer
  engine: Engine
  load_s: float = 0.0
  weights: str = "dense"  # the resolved decode weight format
  quant_bytes: int = 0  # bytes of quantized decode weights (besides the dense ones for prefill)

  @classmethod
  def load(cls, cfg: Config, progress: bool = True,
           tokenizer: Tokenizer | None = None) -> Pipeline:
    """Validates cfg, then loads the checkpoint (and its tokenizer, unless one is given)."""
    validate(cfg)
    t0 = time.perf_counter()
    fmt = resolve_weights(cfg)
    model_cfg, tensors, tokenizer, blocks = load_model_and_tokenizer(
        cfg.checkpoint, progress, tokenizer, blocks=fmt == "gguf")
    cfg = dataclasses.replace(cfg, model=model_cfg)
    placement.place_for(cfg.attention.kind)  # before any weight reaches a device
    model = from_hf_tensors(model_cfg, tensors, dtype=_DTYPES[cfg.dtype])
    quant_bytes = 0 if fmt == "dense" else attach_quantized(model, tensors, fmt, blocks,
                                                                 cfg.act_bits)
    del tensors, blocks
    engine = Engine(cfg, model, make_backend(cfg))
    return cls(cfg, model, tokenizer, engine, load_s=time.perf_counter() - t0, weights=fmt,
               quant_bytes=quant_bytes)

  def with_attention(self, attention: AttentionConfig) -> Pipeline:
    """The same weights and tokenizer with another attention backend (nothing is reloaded)."""
    cfg = dataclasses.replace(self.cfg, attention=attention)
    validate(cfg)
    placement.place_for(attention.kind)
    return dataclasses.replace(self, cfg=cfg, engine=Engine(cfg, self.model, make_backend(cfg)))

  def encode(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
    """Prompt ids; with `chat`, rendered through the checkpoint's chat template first."""
    return encode_prompt(self.tokenizer, prompt, chat, system)

  def generate(self, prompts: Sequence[str], *, chat: bool = False, system: str | None = None,
               sampling_cfg: SamplingConfig | None = None,
               on_text: Callable[[int, str], None] | None = None,
               progress: bool = False) -> tuple[list[GenerationResult], GenerationStats]:
    """Generates a continuation for each prompt (batched).

    Args:
      prompts: texts (user messages when `chat`).
      on_text: `on_text(slot, text_piece)` streams decoded text as tokens arrive.
    """
    sc = sampling_cfg or self.cfg.sampling
    ids = [self.encode(p, chat, system) for p in prompts]
    check_prompt_lengths(ids, sc.max_new_tokens, self.cfg.max_seq_len, self.cfg.model.max_position)
    checkers = [sampling.StopChecker(self.tokenizer.stop_ids, sc.stop_strings, self.tokenizer)
                for _ in ids]
    streams = [self.tokenizer.stream_decoder() for _ in ids]

    def stop(slot: int, new_ids: list[int]) -> str | None:
      status = checkers[slot].check(new_ids)
      return status.reason if status.stopped else None

    def on_token(slot: int, tok: int) -> None:
      if on_text:
        piece = streams[slot].push(tok)
        if piece:
          on_text(slot, piece)

    new_ids, reasons, stats = self.engine.generate(ids, sc, stop=stop, on_token=on_token,
                                                   progress=progress)
    results = []
    for i, (p, n, r) in enumerate(zip(ids, new_ids, reasons)):
      status = checkers[i].check(n)
      results.append(GenerationResult(prompt_ids=p, token_ids=n[:status.num_tokens],
                                      text=status.text, stop_reason=r))
    return results, stats
