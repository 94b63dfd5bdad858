"""Wires a loaded model, the slot batch, the scheduler thread and the HTTP app together."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pigjax.config import Config
from pigjax.pipeline import Pipeline
from pigjax.serving.batch import SlotBatch
from pigjax.serving.scheduler import RequestParams, Scheduler


@dataclasses.dataclass
class Service:
  cfg: Config
  pipeline: Pipeline
  scheduler: Scheduler
  model_name: str
  app: object  # the FastAPI app


def model_name_for(cfg: Config) -> str:
  """The id clients send as `model`: config.serve.model_name, else the checkpoint's name."""
  if cfg.serve.model_name:
    return cfg.serve.model_name
  return Path(cfg.checkpoint.rstrip("/")).name or cfg.checkpoint


def build_scheduler(pipe: Pipeline, warmup: bool = True) -> Scheduler:
  """A scheduler over `pipe`'s model with `pipe.cfg.serve.slots` rows of `max_seq_len`
  positions; `warmup` compiles the common programs with a one-token request first, so the
  first client does not wait for compilation."""
  cfg = pipe.cfg
  limit = min(cfg.max_seq_len, cfg.model.max_position)
  batch = SlotBatch(cfg, pipe.model, cfg.serve.slots, limit)
  scheduler = Scheduler(batch, pipe.tokenizer, limit)
  if warmup:
    outs = []
    scheduler.submit(pipe.tokenizer.encode("Hi") or [0], RequestParams(max_tokens=2),
                     outs.append)
    scheduler.run_until_idle()
    if outs[-1].finish_reason == "error":  # the scheduler keeps serving; a server must not
      raise RuntimeError(f"The warm-up request failed: {outs[-1].error}")
  return scheduler


def build_service(cfg: Config, progress: bool = False) -> Service:
  """Loads the checkpoint, starts the scheduler thread and builds the app."""
  from pigjax.serving.server import create_app  # fastapi is the serve extra's
  if cfg.serve.slots < 1 or cfg.serve.default_max_tokens < 1:
    raise ValueError(f"serve.slots ({cfg.serve.slots}) and serve.default_max_tokens "
                     f"({cfg.serve.default_max_tokens}) must be >= 1.")
  if cfg.serve.max_body_bytes < 1:
    raise ValueError(f"serve.max_body_bytes must be >= 1, got {cfg.serve.max_body_bytes}.")
  pipe = Pipeline.load(cfg, progress=progress)
  scheduler = build_scheduler(pipe)
  scheduler.start()
  name = model_name_for(cfg)
  app = create_app(scheduler, pipe.tokenizer, name, pipe.cfg.attention.kind,
                   pipe.cfg.serve.default_max_tokens, pipe.cfg.serve.max_body_bytes)
  return Service(pipe.cfg, pipe, scheduler, name, app)
