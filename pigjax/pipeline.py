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

from pigjax import placement, sampling, weights
from pigjax.config import AttentionConfig, Config, SamplingConfig
from pigjax.engine import DenseBackend, Engine, GenerationResult, GenerationStats
from pigjax.model import Llama, from_hf_tensors
from pigjax.tokenizer import Tokenizer

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def make_backend(cfg: Config):
  if cfg.attention.kind == "dense":
    return DenseBackend(cfg)
  if cfg.attention.kind == "magicpig":
    from pigjax.magicpig import MagicPigBackend  # the host store is only built when asked for
    return MagicPigBackend(cfg)
  raise ValueError(f"Unknown attention.kind {cfg.attention.kind!r}; use 'dense' or 'magicpig'.")


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


def load_model_and_tokenizer(spec: str, progress: bool = True):
  """(ModelConfig, HF-named tensors, Tokenizer); a GGUF's header is parsed once for both."""
  gguf_path = _gguf_path(spec)
  if gguf_path is not None and gguf_path.suffix == ".gguf":
    import gguf
    try:
      reader = gguf.GGUFReader(gguf_path)
    except Exception as e:
      raise ValueError(f"{gguf_path} is not a readable GGUF file ({e}).") from e
    return (*weights.load_gguf(reader, progress=progress), Tokenizer.from_gguf(reader))
  tokenizer = load_tokenizer(spec)
  model_cfg, tensors, _ = weights.load_checkpoint(spec, progress=progress)
  return model_cfg, tensors, tokenizer


def validate(cfg: Config) -> None:
  """Cheap checks that run before any weight is read."""
  if not cfg.checkpoint:
    raise ValueError("config.checkpoint is empty: set --config.checkpoint to 'smollm2', a .gguf "
                     "file, a Hugging Face Llama directory or a pigjax Orbax checkpoint.")
  if cfg.dtype not in _DTYPES:
    raise ValueError(f"Unknown dtype {cfg.dtype!r}; use one of {sorted(_DTYPES)}.")
  if cfg.attention.kind not in ("dense", "magicpig"):
    raise ValueError(f"Unknown attention.kind {cfg.attention.kind!r}; use 'dense' or 'magicpig'.")
  if cfg.prefill_chunk < 1 or cfg.max_seq_len < 2:
    raise ValueError(f"prefill_chunk={cfg.prefill_chunk} and max_seq_len={cfg.max_seq_len} must "
                     "be positive.")
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

  @classmethod
  def load(cls, cfg: Config, progress: bool = True) -> Pipeline:
    validate(cfg)
    t0 = time.perf_counter()
    model_cfg, tensors, tokenizer = load_model_and_tokenizer(cfg.checkpoint, progress)
    cfg = dataclasses.replace(cfg, model=model_cfg)
    placement.place_for(cfg.attention.kind)  # before any weight reaches a device
    model = from_hf_tensors(model_cfg, tensors, dtype=_DTYPES[cfg.dtype])
    del tensors
    engine = Engine(cfg, model, make_backend(cfg))
    return cls(cfg, model, tokenizer, engine, load_s=time.perf_counter() - t0)

  def with_attention(self, attention: AttentionConfig) -> Pipeline:
    """The same weights and tokenizer with another attention backend (nothing is reloaded)."""
    cfg = dataclasses.replace(self.cfg, attention=attention)
    validate(cfg)
    placement.place_for(attention.kind)
    return dataclasses.replace(self, cfg=cfg, engine=Engine(cfg, self.model, make_backend(cfg)))

  def encode(self, prompt: str, chat: bool = False, system: str | None = None) -> list[int]:
    """Prompt ids; with `chat`, rendered through the checkpoint's chat template first."""
    if chat:
      messages = ([{"role": "system", "content": system}] if system else [])
      messages.append({"role": "user", "content": prompt})
      return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))
    return self.tokenizer.encode(prompt)

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
    limit = min(self.cfg.model.max_position, self.cfg.max_seq_len)
    for i, p in enumerate(ids):
      if len(p) + sc.max_new_tokens > limit:
        raise ValueError(
            f"Prompt {i} has {len(p)} tokens; with max_new_tokens={sc.max_new_tokens} that exceeds "
            f"the context limit of {limit} tokens.")
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
