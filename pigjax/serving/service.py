"""Wires a loaded model, the slot batch, the scheduler thread and the HTTP app together."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from pigjax.config import Config, ServeConfig
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
  scheduler = Scheduler(batch, pipe.tokenizer, limit, max_waiting=cfg.serve.max_waiting)
  if warmup:
    outs = []
    scheduler.submit(pipe.tokenizer.encode("Hi") or [0], RequestParams(max_tokens=2),
                     outs.append)
    scheduler.run_until_idle()
    if outs[-1].finish_reason == "error":  # the scheduler keeps serving; a server must not
      raise RuntimeError(f"The warm-up request failed: {outs[-1].error}")
  return scheduler


def validate_serve(s: ServeConfig) -> None:
  """Raises ValueError naming the first bad serve.* setting (before the model loads)."""
  checks = [
      (s.slots >= 1, f"serve.slots must be >= 1, got {s.slots}."),
      (s.default_max_tokens >= 1,
       f"serve.default_max_tokens must be >= 1, got {s.default_max_tokens}."),
      (s.max_body_bytes >= 1, f"serve.max_body_bytes must be >= 1, got {s.max_body_bytes}."),
      (s.max_waiting >= 0, f"serve.max_waiting must be >= 0 (0: no bound), got {s.max_waiting}."),
      (s.max_tokens_limit >= 0,
       f"serve.max_tokens_limit must be >= 0 (0: the context), got {s.max_tokens_limit}."),
      (s.max_messages >= 1, f"serve.max_messages must be >= 1, got {s.max_messages}."),
      (s.max_stop_strings >= 0,
       f"serve.max_stop_strings must be >= 0, got {s.max_stop_strings}."),
      (s.max_stop_chars >= 1, f"serve.max_stop_chars must be >= 1, got {s.max_stop_chars}."),
      (math.isfinite(s.request_timeout) and s.request_timeout >= 0,
       f"serve.request_timeout must be seconds >= 0 (0: no deadline), got {s.request_timeout}."),
      (math.isfinite(s.shutdown_grace_s) and s.shutdown_grace_s >= 0,
       f"serve.shutdown_grace_s must be seconds >= 0, got {s.shutdown_grace_s}."),
      (all(isinstance(k, str) and k and k.strip() == k and "," not in k for k in s.api_keys),
       "serve.api_keys must be non-empty strings without surrounding spaces or commas."),
  ]
  for ok, message in checks:
    if not ok:
      raise ValueError(message)


def build_service(cfg: Config, progress: bool = False) -> Service:
  """Loads the checkpoint, starts the scheduler thread and builds the app."""
  from pigjax.serving.server import create_app  # fastapi is the serve extra's
  validate_serve(cfg.serve)
  pipe = Pipeline.load(cfg, progress=progress)
  scheduler = build_scheduler(pipe)
  scheduler.start()
  name = model_name_for(cfg)
  app = create_app(scheduler, pipe.tokenizer, name, pipe.cfg.attention.kind, pipe.cfg.serve)
  return Service(pipe.cfg, pipe, scheduler, name, app)
