"""The OpenAI-compatible HTTP layer (FastAPI): /v1/models, /v1/completions, /v1/chat/completions,
/health, /metrics. It parses and validates requests, submits them to a `Scheduler` running on its
own thread, and forwards each request's outputs, as server-sent events when `stream` is true.

What an operator needs sits in one ASGI middleware (`_Gate`) in front of every route: with
`serve.api_keys` set, every request but /health needs `Authorization: Bearer <key>` (401
otherwise; keys compared in constant time, never logged); while the server drains for shutdown
(`Ops.drain`), new requests get 503; every request is counted in the app's own Prometheus
registry (`Metrics`, served at /metrics) and gets one access-log line on the
`pigjax.serving.access` logger (no prompt text unless `serve.log_prompts`). A full waiting queue
answers 429 with Retry-After; a request's deadline (`timeout`, `serve.request_timeout`) ends it
with finish_reason "length" and `"pigjax": {"timed_out": true}`, as llama-server's time limit
does.

A client that disconnects cancels its request, so its row is freed for the next one: a stream
notices when its next event cannot be sent, a non-streaming request polls for the disconnect
every `DISCONNECT_POLL_S`.

Nothing a client sends reaches the scheduler unchecked: the body is size-limited (413) and parsed
strictly (`protocol.parse_body`), every field is validated (400 naming it), and tokenising runs
off the event loop, so one large prompt does not stall `/health` or the other streams. Any
other exception still answers in OpenAI's JSON error format (500).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily

from pigjax.config import ServeConfig
from pigjax.serving import protocol
from pigjax.serving.protocol import ApiError
from pigjax.serving.scheduler import Output, PromptTooLong, QueueFull, Scheduler

DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks that its client is there
RETRY_AFTER_S = 1  # the Retry-After of a 429 (a row frees as soon as any request ends)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
OPEN_PATHS = ("/health",)  # answered without a key
access_log = logging.getLogger("pigjax.serving.access")

# Histogram buckets (seconds), close to vLLM's for the same metrics.
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
_FRACTION_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)


class Metrics:
  """The app's Prometheus metrics, in a registry of its own (several apps in one process, as in
  the tests, do not share counters)."""

  def __init__(self, scheduler: Scheduler):
    self.registry = r = CollectorRegistry()
    self.requests = Counter("pigjax_requests", "HTTP requests answered, by endpoint and status.",
                            ["endpoint", "status"], registry=r)
    self.latency = Histogram("pigjax_request_latency_seconds",
                             "Seconds from a request's arrival to the end of its response.",
                             ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
    self.prompt_tokens = Counter("pigjax_prompt_tokens", "Prompt tokens prefilled.", registry=r)
    self.generation_tokens = Counter("pigjax_generation_tokens", "Tokens generated.",
                                     registry=r)
    self.finished = Counter("pigjax_request_finished",
                            "Generation requests ended, by finish reason (stop, length, "
                            "timeout, cancelled, error).", ["finish_reason"], registry=r)
    self.ttft = Histogram("pigjax_time_to_first_token_seconds",
                          "Seconds from a request's arrival to its first generated token.",
                          buckets=_TTFT_BUCKETS, registry=r)
    self.itl = Histogram("pigjax_inter_token_latency_seconds",
                         "Seconds between a request's consecutive generated tokens.",
                         buckets=_ITL_BUCKETS, registry=r)
    self.attended = Histogram("pigjax_attended_fraction",
                              "MagicPIG: the share of its pool each finished request attended.",
                              buckets=_FRACTION_BUCKETS, registry=r)
    Gauge("pigjax_num_requests_waiting", "Requests waiting for a row (or being prefilled).",
          registry=r).set_function(lambda: scheduler.num_waiting)
    Gauge("pigjax_num_requests_running", "Rows busy decoding a request.",
          registry=r).set_function(lambda: scheduler.num_running)
    Gauge("pigjax_slots", "Rows of the batch (serve.slots).", registry=r).set(
        scheduler.batch.slots)
    r.register(_HostStoreCollector(scheduler.batch))

  def text(self) -> bytes:
    return generate_latest(self.registry)


class _HostStoreCollector:
  """pigjax_host_store_bytes: the MagicPIG host store's allocated bytes, when the batch's
  backend has a store (dense serving exports nothing)."""

  def __init__(self, batch):
    self.batch = batch

  def describe(self):
    return []  # nothing to collect at registration

  def collect(self):
    store = getattr(getattr(self.batch, "backend", None), "store", None)
    if store is None:
      return
    try:  # a host-side call under the store's own lock; a store being rebuilt is skipped
      allocated = store.memory_bytes()
    except Exception:
      return
    yield GaugeMetricFamily("pigjax_host_store_bytes",
                            "Bytes the MagicPIG host KV store has allocated (pools grow up to "
                            "their capacity).", value=allocated)


@dataclasses.dataclass
class _Access:
  """One request's access-log fields; the generation handlers fill in the request's part."""
  id: str = "-"
  prompt_tokens: int = 0
  completion_tokens: int = 0
  finish_reason: str = "-"
  ttft_s: float | None = None
  prompt: str | None = None  # only with serve.log_prompts


class _Tracker:
  """Called with each Output of one request, on the scheduler thread: times the first token and
  the gaps between tokens, counts tokens, and fills the request's access-log record."""

  def __init__(self, metrics: Metrics, arrived: float, access: _Access):
    self.metrics, self.arrived, self.access = metrics, arrived, access
    self.last: float | None = None

  def __call__(self, out: Output) -> None:
    m, now = self.metrics, time.monotonic()
    if out.token_ids:
      if self.last is None:
        m.ttft.observe(now - self.arrived)
        m.prompt_tokens.inc(out.prompt_tokens)
        self.access.ttft_s = now - self.arrived
      else:
        m.itl.observe((now - self.last) / len(out.token_ids))
      self.last = now
      m.generation_tokens.inc(len(out.token_ids))
    if out.finish_reason is not None:
      m.finished.labels(out.finish_reason).inc()
      if out.pool_fraction is not None:
        m.attended.observe(out.pool_fraction)
      self.access.prompt_tokens = out.prompt_tokens
      self.access.completion_tokens = out.completion_tokens
      self.access.finish_reason = out.finish_reason


class Ops:
  """What the operator controls in one app: its API keys, its drain for shutdown, the requests
  in flight, and its metrics."""

  def __init__(self, scheduler: Scheduler, api_keys, log_prompts: bool):
    self.keys = [k.encode() for k in api_keys if k]
    self.log_prompts = log_prompts
    self.metrics = Metrics(scheduler)
    self.draining = False
    self.in_flight = 0  # requests (but /health, /metrics) being answered, streams included
    self._lock = threading.Lock()

  def authorized(self, header: bytes | None) -> bool:
    """Whether an Authorization header value carries one of the keys (constant time in the
    key's content; every key is compared, so the time does not tell which one matched)."""
    if not self.keys:
      return True
    scheme, _, token = (header or b"").partition(b" ")
    ok = False
    for key in self.keys:
      ok |= hmac.compare_digest(token.strip(), key)
    return ok and scheme.lower() == b"bearer"

  def drain(self) -> None:
    """New requests get 503 from now on; the running ones go on."""
    self.draining = True

  def wait_idle(self, timeout: float) -> bool:
    """Waits up to `timeout` seconds for the requests in flight to end; whether they did."""
    deadline = time.monotonic() + timeout
    while self.in_flight and time.monotonic() < deadline:
      time.sleep(0.05)
    return not self.in_flight

  def _enter(self, delta: int) -> None:
    with self._lock:
      self.in_flight += delta


class _Gate:
  """ASGI middleware in front of every route: the API key, the drain, the request counters
  and the access log (module docstring)."""

  def __init__(self, app, ops: Ops):
    self.app, self.ops = app, ops

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    ops, path = self.ops, scope["path"]
    start = time.monotonic()
    access = _Access()
    scope.setdefault("state", {}).update(access=access, arrived=start)
    status = 500  # unless a response starts

    async def send_status(message):
      nonlocal status
      if message["type"] == "http.response.start":
        status = message["status"]
      await send(message)

    try:
      if path not in OPEN_PATHS and not ops.authorized(_header(scope, b"authorization")):
        await _send_error(send_status, ApiError(
            401, "Incorrect API key provided: send it as 'Authorization: Bearer <key>'.",
            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
      elif ops.draining and path not in ("/health", "/metrics"):
        await _send_error(send_status, ApiError(
            503, "The server is shutting down and takes no new requests.",
            type_="unavailable_error", code="server_shutting_down"))
      else:
        counted = path not in ("/health", "/metrics")
        if counted:
          ops._enter(1)
        try:
          await self.app(scope, receive, send_status)
        finally:
          if counted:
            ops._enter(-1)
    finally:
      elapsed = time.monotonic() - start
      endpoint = path if path in ENDPOINTS else "other"
      ops.metrics.requests.labels(endpoint, str(status)).inc()
      ops.metrics.latency.labels(endpoint).observe(elapsed)
      _log_access(scope, access, status, elapsed)


def _header(scope, name: bytes) -> bytes | None:
  for k, v in scope.get("headers", ()):
    if k.lower() == name:
      return v
  return None


async def _send_error(send, e: ApiError) -> None:
  body = json.dumps(e.body()).encode()
  headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
  headers += [(k.lower().encode(), v.encode()) for k, v in (e.headers or {}).items()]
  await send({"type": "http.response.start", "status": e.status, "headers": headers})
  await send({"type": "http.response.body", "body": body})


def _log_access(scope, a: _Access, status: int, elapsed: float) -> None:
  if not access_log.isEnabledFor(logging.INFO):
    return
  client = scope.get("client")
  ttft = f"{a.ttft_s * 1e3:.1f}" if a.ttft_s is not None else "-"
  line = (f"{a.id} {client[0] if client else '-'} {scope['method']} {scope['path']} {status} "
          f"prompt_tokens={a.prompt_tokens} completion_tokens={a.completion_tokens} "
          f"finish={a.finish_reason} ttft_ms={ttft} latency_ms={elapsed * 1e3:.1f}")
  if a.prompt is not None:
    line += f" prompt={json.dumps(a.prompt, ensure_ascii=False)}"
  access_log.info("%s", line)


def create_app(scheduler: Scheduler, tokenizer, model_name: str, attention: str,
               serve: ServeConfig = ServeConfig()) -> FastAPI:
  """The FastAPI app over a started scheduler (`Scheduler.start`).

  Args:
    serve: the server's settings (default_max_tokens, max_body_bytes, api_keys, the request
      limits, request_timeout, log_prompts); the scheduler holds max_waiting.
  The app's `Ops` (keys, drain, metrics) is `app.state.ops`.
  """
  ops = Ops(scheduler, serve.api_keys, serve.log_prompts)
  # Without keys the schema is as public as the API; with keys it is not served at all.
  app = FastAPI(title="pigjax", docs_url=None, redoc_url=None,
                openapi_url=None if ops.keys else "/openapi.json")
  app.state.ops = ops
  app.add_middleware(_Gate, ops=ops)
  created = int(time.time())
  default_max_tokens, max_body_bytes = serve.default_max_tokens, serve.max_body_bytes

  def params_of(request: Request, body: dict):
    """The sampling settings, and the deadline (time.monotonic(); None: none) counted from
    the request's arrival."""
    params = protocol.parse_params(body, default_max_tokens, serve.max_tokens_limit,
                                   serve.max_stop_strings, serve.max_stop_chars)
    timeout = protocol.request_timeout(body, serve.request_timeout)
    return params, None if timeout is None else request.state.arrived + timeout

  @app.exception_handler(ApiError)
  async def _api_error(_, e: ApiError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

  @app.exception_handler(Exception)  # a bug: the client still gets JSON (uvicorn logs it)
  async def _server_error(_, e: Exception):
    return JSONResponse(ApiError(500, f"Internal error: {type(e).__name__}.",
                                 type_="server_error").body(), status_code=500)

  @app.exception_handler(404)
  async def _not_found(request: Request, _):
    return JSONResponse(ApiError(404, f"No route {request.url.path}.", code="not_found").body(),
                        status_code=404)

  @app.exception_handler(405)
  async def _bad_method(request: Request, _):
    return JSONResponse(ApiError(405, f"{request.method} is not allowed on {request.url.path}."
                                 ).body(), status_code=405)

  @app.get("/health")
  async def health():
    body = {"status": "draining" if ops.draining else "ok", "model": model_name,
            "attention": attention, "slots": scheduler.batch.slots,
            "running": scheduler.num_running, "waiting": scheduler.num_waiting,
            "finished": dict(scheduler.finished)}
    return JSONResponse(body, status_code=503 if ops.draining else 200)

  @app.get("/metrics")
  def metrics():  # a thread of its own: the host store's byte count takes the store's lock
    return Response(ops.metrics.text(), media_type=CONTENT_TYPE_LATEST)

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "pigjax"}]}

  @app.post("/v1/completions")
  async def completions(request: Request):
    body = await _json_body(request, max_body_bytes)
    protocol.check_model(body, model_name)
    prompt = protocol.completion_prompt(body)
    params, deadline = params_of(request, body)  # every field before the work
    if ops.log_prompts:
      request.state.access.prompt = prompt
    prompt_ids = await asyncio.to_thread(tokenizer.encode, prompt)
    return await _generate(request, body, params, prompt_ids, chat=False, deadline=deadline)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    body = await _json_body(request, max_body_bytes)
    protocol.check_model(body, model_name)
    messages = protocol.chat_messages(body, serve.max_messages)
    params, deadline = params_of(request, body)

    def render() -> list[int]:
      try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
      except Exception as e:
        raise ApiError(400, f"The chat template could not render these messages: {e}",
                       param="messages") from e
      if ops.log_prompts:
        request.state.access.prompt = text
      return tokenizer.encode(text)

    return await _generate(request, body, params, await asyncio.to_thread(render), chat=True,
                           deadline=deadline)

  async def _generate(request: Request, body: dict, params, prompt_ids: list[int], chat: bool,
                      deadline: float | None):
    stream = protocol.stream_flag(body)
    with_usage = protocol.include_usage(body) if stream else False
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
      # No explicit limit: generate up to the default, within what the context leaves.
      room = scheduler.context_limit - len(prompt_ids)
      params = dataclasses.replace(params, max_tokens=max(1, min(params.max_tokens, room)))
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Output] = asyncio.Queue()
    resp = protocol.Response(model_name, chat)
    access = request.state.access
    access.id = resp.id
    track = _Tracker(ops.metrics, request.state.arrived, access)

    def on_output(out: Output) -> None:  # the scheduler thread
      track(out)
      loop.call_soon_threadsafe(queue.put_nowait, out)

    try:
      rid = scheduler.submit(prompt_ids, params, on_output, deadline=deadline)
    except PromptTooLong as e:
      raise ApiError(400, str(e), param="messages" if chat else "prompt",
                     code="context_length_exceeded") from e
    except QueueFull as e:
      raise ApiError(429, str(e), type_="requests", code="rate_limit_exceeded",
                     headers={"Retry-After": str(RETRY_AFTER_S)}) from e
    except ValueError as e:
      raise ApiError(400, str(e), param=_field_in(str(e))) from e
    if stream:
      return StreamingResponse(_sse(resp, queue, rid, with_usage),
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
    return await _collect(request, resp, queue, rid)

  async def _collect(request: Request, resp: protocol.Response, queue, rid: str):
    parts = []
    next_check = time.monotonic() + DISCONNECT_POLL_S
    try:
      while True:
        try:
          out = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
          out = None
        if out is not None:
          parts.append(out.text)
          if out.finish_reason is not None:
            break
        # Checked on the clock, not only while no token comes: a fast decode never goes
        # quiet, and a client that gave up must not hold its row until max_tokens.
        if time.monotonic() >= next_check:
          next_check = time.monotonic() + DISCONNECT_POLL_S
          if await request.is_disconnected():
            scheduler.cancel(rid)
            return JSONResponse({}, status_code=499)
    except asyncio.CancelledError:
      scheduler.cancel(rid)
      raise
    if out.finish_reason == "error":
      raise ApiError(500, f"Generation failed: {out.error}", type_="server_error")
    extra = _extra(out)
    return resp.full("".join(parts), _client_reason(out), out.prompt_tokens,
                     out.completion_tokens, extra or None)

  async def _sse(resp: protocol.Response, queue, rid: str, with_usage: bool):
    finished = False
    try:
      if resp.chat:
        yield _event(resp.chunk("", None, role=True))
      while True:
        out = await queue.get()
        if out.finish_reason == "error":
          finished = True
          yield _event(ApiError(500, f"Generation failed: {out.error}",
                                type_="server_error").body())
          break
        if out.text:
          yield _event(resp.chunk(out.text, None))
        if out.finish_reason is not None:
          finished = True
          last = resp.chunk(None if resp.chat else "", _client_reason(out))
          if out.finish_reason == "timeout":
            last["pigjax"] = {"timed_out": True}
          yield _event(last)
          if with_usage:
            yield _event(resp.usage_chunk(out.prompt_tokens, out.completion_tokens))
          break
      yield "data: [DONE]\n\n"
    finally:
      if not finished:  # the client went away (or the stream failed): free the row
        scheduler.cancel(rid)

  return app


async def _json_body(request: Request, limit: int) -> dict:
  """The parsed body; 413 past `limit` bytes, checked on Content-Length and while reading."""
  too_big = ApiError(413, f"The request body is larger than this server's limit of {limit} "
                          "bytes (serve.max_body_bytes).", code="request_too_large")
  declared = request.headers.get("content-length", "")
  if declared.isdigit() and int(declared) > limit:
    raise too_big
  chunks, size = [], 0
  async for chunk in request.stream():
    size += len(chunk)
    if size > limit:
      raise too_big
    chunks.append(chunk)
  raw = b"".join(chunks)
  if size > 2**16:  # parsing a large body takes long enough to stall the other requests
    return await asyncio.to_thread(protocol.parse_body, raw)
  return protocol.parse_body(raw)


def _client_reason(out: Output) -> str:
  """The OpenAI finish_reason: a deadline ends a request as its length limit does."""
  return "length" if out.finish_reason == "timeout" else out.finish_reason


def _extra(out: Output) -> dict:
  """The response's "pigjax" fields: MagicPIG's attended share, whether a deadline ended it."""
  extra = {}
  if out.pool_fraction is not None:
    extra["pool_fraction"] = out.pool_fraction
  if out.finish_reason == "timeout":
    extra["timed_out"] = True
  return extra


def _event(obj: dict) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _field_in(message: str) -> str | None:
  """The sampling field a pigjax validation message names (its first word)."""
  word = message.split(" ", 1)[0]
  return {"max_new_tokens": "max_tokens"}.get(word, word) if word.isidentifier() else None
