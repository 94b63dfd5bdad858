"""OpenAI request parsing and response bodies (completions and chat completions).

Only the fields pigjax acts on are read; a field pigjax cannot honour (n > 1, logprobs,
non-zero presence/frequency penalties, tools) is refused with a 400 that names it rather than
silently ignored. Sampling extensions accepted beside OpenAI's own: top_k, min_p,
repetition_penalty, and ignore_eos (vLLM's: generate max_tokens tokens, for benchmarks).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pigjax.serving.scheduler import RequestParams


class ApiError(Exception):
  """An error answered as OpenAI's JSON error body."""

  def __init__(self, status: int, message: str, param: str | None = None,
               code: str | None = None, type_: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def _bad(param: str, message: str) -> ApiError:
  return ApiError(400, message, param=param)


def _number(body: dict, name: str, default, kind=float, lo=None, hi=None, lo_open=False):
  v = body.get(name, default)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and
                                                                   not float(v).is_integer()):
    raise _bad(name, f"'{name}' must be {'an integer' if kind is int else 'a number'}, got "
                     f"{v!r}.")
  if v != v or (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
    rng = (f"{'>' if lo_open else '>='} {lo}" if hi is None else
           f"in {'(' if lo_open else '['}{lo}, {hi}]")
    raise _bad(name, f"'{name}' must be {rng}, got {v!r}.")
  return kind(v)


def parse_params(body: dict, default_max_tokens: int) -> RequestParams:
  """RequestParams from an OpenAI body; raises ApiError(400) naming the bad field."""
  for name, off in (("n", 1), ("best_of", 1), ("presence_penalty", 0), ("frequency_penalty", 0)):
    if body.get(name, off) not in (None, off):
      raise _bad(name, f"'{name}' is not supported by pigjax (only {off}).")
  for name in ("logprobs", "top_logprobs", "tools", "functions", "logit_bias", "suffix"):
    if body.get(name) not in (None, False, {}, []):
      raise _bad(name, f"'{name}' is not supported by pigjax.")
  if body.get("echo"):
    raise _bad("echo", "'echo' is not supported by pigjax.")
  max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
  name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
  max_tokens = (default_max_tokens if max_tokens is None else
                _number({name: max_tokens}, name, None, int, lo=1))
  stop = body.get("stop")
  if stop is None:
    stop = ()
  elif isinstance(stop, str):
    stop = (stop,)
  elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
    stop = tuple(stop)
  else:
    raise _bad("stop", "'stop' must be a string or a list of at most 16 strings.")
  seed = body.get("seed")
  if seed is not None:
    seed = _number(body, "seed", None, int)
  return RequestParams(
      max_tokens=max_tokens,
      temperature=_number(body, "temperature", 1.0, lo=0, hi=2),
      top_p=_number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True),
      top_k=_number(body, "top_k", 0, int, lo=0),
      min_p=_number(body, "min_p", 0.0, lo=0, hi=1),
      repetition_penalty=_number(body, "repetition_penalty", 1.0, lo=0, lo_open=True),
      seed=seed, stop=tuple(s for s in stop if s), ignore_eos=bool(body.get("ignore_eos", False)))


def check_model(body: dict, served: str) -> None:
  model = body.get("model")
  if not isinstance(model, str) or not model:
    raise _bad("model", "'model' is required: a string naming the served model "
                        f"('{served}').")
  if model != served:
    raise ApiError(404, f"The model '{model}' does not exist; this server serves '{served}'.",
                   param="model", code="model_not_found")


def completion_prompt(body: dict) -> str:
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
    prompt = prompt[0]
  if not isinstance(prompt, str):
    raise _bad("prompt", "'prompt' must be a string (one prompt per request).")
  if not prompt:
    raise _bad("prompt", "'prompt' is empty.")
  return prompt


def chat_messages(body: dict) -> list[dict]:
  """Messages with string contents (text parts are joined); raises ApiError naming the field."""
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise _bad("messages", "'messages' must be a non-empty list of {role, content} objects.")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant",
                                                        "developer", "tool"):
      raise _bad(f"messages[{i}].role", f"messages[{i}] needs a role of system, user, "
                                        "assistant, developer or tool.")
    content = m.get("content")
    if isinstance(content, list):
      if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        raise _bad(f"messages[{i}].content", "Only text content parts are supported.")
      content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
      raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string.")
    role = "system" if m["role"] == "developer" else m["role"]
    out.append({"role": role, "content": content})
  return out


def include_usage(body: dict) -> bool:
  opts = body.get("stream_options")
  if opts is None:
    return False
  if not isinstance(opts, dict):
    raise _bad("stream_options", "'stream_options' must be an object.")
  return bool(opts.get("include_usage"))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


class Response:
  """Builds the JSON objects of one response (its id and creation time are fixed)."""

  def __init__(self, model: str, chat: bool):
    self.model, self.chat = model, chat
    self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    self.created = int(time.time())

  def _obj(self, kind: str, **fields) -> dict:
    return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
            **fields}

  def full(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
           extra: dict | None = None) -> dict:
    if self.chat:
      choice = {"index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason, "logprobs": None}
      kind = "chat.completion"
    else:
      choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
      kind = "text_completion"
    body = self._obj(kind, choices=[choice], usage=usage(prompt_tokens, completion_tokens))
    if extra:
      body["pigjax"] = extra
    return body

  def chunk(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
    if self.chat:
      delta: dict[str, Any] = {"role": "assistant"} if role else {}
      if text is not None:
        delta["content"] = text
      choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
      return self._obj("chat.completion.chunk", choices=[choice])
    choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
    return self._obj("text_completion", choices=[choice])

  def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
    kind = "chat.completion.chunk" if self.chat else "text_completion"
    return self._obj(kind, choices=[], usage=usage(prompt_tokens, completion_tokens))
