"""OpenAI request parsing and response bodies (completions and chat completions).

Only the fields pigjax acts on are read; a field pigjax cannot honour (n > 1, logprobs,
non-zero presence/frequency penalties, tools) is refused with a 400 that names it rather than
silently ignored. Sampling extensions accepted beside OpenAI's own: top_k, min_p,
repetition_penalty, and ignore_eos (vLLM's: generate max_tokens tokens, for benchmarks).

Every field is checked for its JSON type and for a range that fits the scheduler's per-row
operands (int32 and float32) before the request is queued, so nothing a client sends can fail
inside the shared decode step. Booleans must be JSON booleans: "false" is a non-empty string.
The operator's limits (`serve.max_tokens_limit`, `max_messages`, `max_stop_strings`,
`max_stop_chars`) are checked here too, each with a 400 naming the field and the setting.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from pigjax.serving.scheduler import RequestParams


class ApiError(Exception):
  """An error answered as OpenAI's JSON error body."""

  def __init__(self, status: int, message: str, param: str | None = None,
               code: str | None = None, type_: str = "invalid_request_error",
               headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
    self.headers = headers  # sent with the error (Retry-After, WWW-Authenticate)

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def _bad(param: str, message: str) -> ApiError:
  return ApiError(400, message, param=param)


INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1  # OpenAI's (and vLLM's) range for seed
MAX_PENALTY = 100.0  # repetition_penalty's upper bound: finite in float32, far past any use
MAX_INT_DIGITS = 40  # longer integer literals are kept as `_LongInt`, never converted
MAX_TIMEOUT_S = 1e7  # a request's `timeout` bound (finite; about four months)
_SURROGATE = re.compile("[\ud800-\udfff]")


class _LongInt:
  """An integer literal too long to be any field's value (Python refuses to convert 4,300+
  digits, and converting one costs quadratic time); `_number` reports it as out of range, and
  every other field rejects it as not of its type."""

  def __init__(self, literal: str):
    self.digits = len(literal.lstrip("-"))


def parse_body(raw: bytes) -> dict:
  """The request body as a JSON object; raises ApiError(400) for anything else.

  Rejected here, before any field is read: invalid JSON or UTF-8, nesting past the parser's
  recursion limit, and lone surrogates (\\ud800 escapes), which no tokenizer can encode.
  """
  try:
    body = json.loads(raw, parse_int=lambda s: int(s) if len(s) <= MAX_INT_DIGITS else
                      _LongInt(s))
  except RecursionError as e:
    raise ApiError(400, "The request body is nested too deeply to be parsed.") from e
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
    raise ApiError(400, f"The request body is not valid JSON ({e}).") from e
  if not isinstance(body, dict):
    raise ApiError(400, "The request body must be a JSON object.")
  where = _find_surrogate(body)
  if where is not None:
    raise _bad(where, f"'{where}' contains a lone UTF-16 surrogate (an unpaired \\ud800-"
                      "\\udfff escape), which is not text.")
  return body


def _find_surrogate(body: dict) -> str | None:
  """The path (OpenAI style, e.g. messages[0].content) of the first string or key holding a
  lone surrogate, or None. Iterative: the parser already bounds the depth, this adds no limit."""
  todo: list[tuple[str, Any]] = [("", body)]
  while todo:
    path, v = todo.pop()
    if isinstance(v, str):
      if _SURROGATE.search(v):
        return path or "body"
    elif isinstance(v, dict):
      for k, x in v.items():
        key = f"{path}.{k}" if path else k
        if _SURROGATE.search(k):
          return path or "body"
        todo.append((key, x))
    elif isinstance(v, list):
      todo.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
  return None


def _number(body: dict, name: str, default, kind=float, lo=None, hi=None, lo_open=False):
  v = body.get(name, default)
  if v is None:
    return default
  rng = (f"{'>' if lo_open else '>='} {lo}" if hi is None else
         f"in {'(' if lo_open else '['}{lo}, {hi}]")
  if isinstance(v, _LongInt):
    raise _bad(name, f"'{name}' must be {rng}, got an integer of {v.digits} digits.")
  if isinstance(v, bool) or not isinstance(v, (int, float)) or (
      kind is int and isinstance(v, float) and not v.is_integer()):
    raise _bad(name, f"'{name}' must be {'an integer' if kind is int else 'a number'}, got "
                     f"{_short(v)}.")
  if v != v or (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
    raise _bad(name, f"'{name}' must be {rng}, got {v!r}.")
  return kind(v)


def _flag(body: dict, name: str, default: bool = False) -> bool:
  """A JSON boolean field (null or absent: the default)."""
  v = body.get(name)
  if v is None:
    return default
  if not isinstance(v, bool):
    raise _bad(name, f"'{name}' must be true or false, got {_short(v)}.")
  return v


def _short(v: Any) -> str:
  r = repr(v)
  return r if len(r) <= 60 else r[:57] + "..."


def parse_params(body: dict, default_max_tokens: int, max_tokens_limit: int = 0,
                 max_stop_strings: int = 16, max_stop_chars: int = 256) -> RequestParams:
  """RequestParams from an OpenAI body; raises ApiError(400) naming the bad field.

  Args:
    max_tokens_limit: the largest max_tokens accepted (0: int32's); it also caps the default.
    max_stop_strings, max_stop_chars: how many stop strings, of how many characters each.
  """
  for name, off in (("n", 1), ("best_of", 1), ("presence_penalty", 0), ("frequency_penalty", 0)):
    if body.get(name, off) not in (None, off):
      raise _bad(name, f"'{name}' is not supported by pigjax (only {off}).")
  for name in ("logprobs", "top_logprobs", "tools", "functions", "logit_bias", "suffix"):
    if body.get(name) not in (None, False, {}, []):
      raise _bad(name, f"'{name}' is not supported by pigjax.")
  if _flag(body, "echo"):
    raise _bad("echo", "'echo' is not supported by pigjax.")
  max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
  name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
  hi = min(max_tokens_limit, INT32_MAX) if max_tokens_limit > 0 else INT32_MAX
  if max_tokens is None:
    max_tokens = min(default_max_tokens, hi)
  else:
    max_tokens = _number({name: max_tokens}, name, None, int, lo=1, hi=INT32_MAX)
    if max_tokens > hi:
      raise _bad(name, f"'{name}' must be at most {hi} on this server "
                       f"(serve.max_tokens_limit), got {max_tokens}.")
  stop = body.get("stop")
  if stop is None:
    stop = ()
  elif isinstance(stop, str):
    stop = (stop,)
  elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
    stop = tuple(stop)
  else:
    raise _bad("stop", "'stop' must be a string or a list of strings.")
  if len(stop) > max_stop_strings:
    raise _bad("stop", f"'stop' may hold at most {max_stop_strings} strings on this server "
                       f"(serve.max_stop_strings), got {len(stop)}.")
  if any(len(s) > max_stop_chars for s in stop):
    raise _bad("stop", f"Each 'stop' string may be at most {max_stop_chars} characters on "
                       f"this server (serve.max_stop_chars), got one of "
                       f"{max(len(s) for s in stop)}.")
  return RequestParams(
      max_tokens=max_tokens,
      temperature=_number(body, "temperature", 1.0, lo=0, hi=2),
      top_p=_number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True),
      top_k=_number(body, "top_k", 0, int, lo=0, hi=INT32_MAX),
      min_p=_number(body, "min_p", 0.0, lo=0, hi=1),
      repetition_penalty=_number(body, "repetition_penalty", 1.0, lo=0, hi=MAX_PENALTY,
                                 lo_open=True),
      seed=_number(body, "seed", None, int, lo=INT64_MIN, hi=INT64_MAX),
      stop=tuple(s for s in stop if s), ignore_eos=_flag(body, "ignore_eos"))


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


def chat_messages(body: dict, max_messages: int = 1024) -> list[dict]:
  """Messages with string contents (text parts are joined); raises ApiError naming the field."""
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise _bad("messages", "'messages' must be a non-empty list of {role, content} objects.")
  if len(messages) > max_messages:
    raise _bad("messages", f"'messages' may hold at most {max_messages} messages on this server "
                           f"(serve.max_messages), got {len(messages)}.")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant",
                                                        "developer", "tool"):
      raise _bad(f"messages[{i}].role", f"messages[{i}] needs a role of system, user, "
                                        "assistant, developer or tool.")
    content = m.get("content")
    if isinstance(content, list):
      for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") != "text":
          raise _bad(f"messages[{i}].content[{j}]", "Only text content parts are supported.")
        if not isinstance(p.get("text"), str):
          raise _bad(f"messages[{i}].content[{j}].text",
                     f"messages[{i}].content[{j}].text must be a string.")
      content = "".join(p["text"] for p in content)
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
  try:
    return _flag(opts, "include_usage")
  except ApiError as e:
    e.param = "stream_options.include_usage"
    raise


def stream_flag(body: dict) -> bool:
  return _flag(body, "stream")


def request_timeout(body: dict, server_timeout: float) -> float | None:
  """Seconds the request may take: its `timeout` field (> 0), at most `server_timeout` when
  that is set (> 0); None when neither is."""
  t = _number(body, "timeout", None, float, lo=0, hi=MAX_TIMEOUT_S, lo_open=True)
  if server_timeout > 0:
    return server_timeout if t is None else min(t, server_timeout)
  return t


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
