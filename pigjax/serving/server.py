"""The OpenAI-compatible HTTP layer (FastAPI): /v1/models, /v1/completions, /v1/chat/completions,
/health. It parses and validates requests, submits them to a `Scheduler` running on its own
thread, and forwards each request's outputs, as server-sent events when `stream` is true.

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
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pigjax.config import ServeConfig
from pigjax.serving import protocol
from pigjax.serving.protocol import ApiError
from pigjax.serving.scheduler import Output, PromptTooLong, Scheduler

DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks that its client is there


def create_app(scheduler: Scheduler, tokenizer, model_name: str, attention: str,
               default_max_tokens: int,
               max_body_bytes: int = ServeConfig.max_body_bytes) -> FastAPI:
  """The FastAPI app over a started scheduler (`Scheduler.start`).

  Args:
    max_body_bytes: the largest request body accepted; a larger one gets 413 before parsing.
  """
  app = FastAPI(title="pigjax", docs_url=None, redoc_url=None)
  created = int(time.time())

  @app.exception_handler(ApiError)
  async def _api_error(_, e: ApiError):
    return JSONResponse(e.body(), status_code=e.status)

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
    return {"status": "ok", "model": model_name, "attention": attention,
            "slots": scheduler.batch.slots, "running": scheduler.num_running,
            "waiting": scheduler.num_waiting, "finished": dict(scheduler.finished)}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                        "owned_by": "pigjax"}]}

  @app.post("/v1/completions")
  async def completions(request: Request):
    body = await _json_body(request, max_body_bytes)
    protocol.check_model(body, model_name)
    prompt = protocol.completion_prompt(body)
    params = protocol.parse_params(body, default_max_tokens)  # every field before the work
    prompt_ids = await asyncio.to_thread(tokenizer.encode, prompt)
    return await _generate(request, body, params, prompt_ids, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    body = await _json_body(request, max_body_bytes)
    protocol.check_model(body, model_name)
    messages = protocol.chat_messages(body)
    params = protocol.parse_params(body, default_max_tokens)

    def render() -> list[int]:
      try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
      except Exception as e:
        raise ApiError(400, f"The chat template could not render these messages: {e}",
                       param="messages") from e
      return tokenizer.encode(text)

    return await _generate(request, body, params, await asyncio.to_thread(render), chat=True)

  async def _generate(request: Request, body: dict, params, prompt_ids: list[int], chat: bool):
    stream = protocol.stream_flag(body)
    with_usage = protocol.include_usage(body) if stream else False
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
      # No explicit limit: generate up to the default, within what the context leaves.
      room = scheduler.context_limit - len(prompt_ids)
      params = dataclasses.replace(params, max_tokens=max(1, min(params.max_tokens, room)))
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Output] = asyncio.Queue()
    try:
      rid = scheduler.submit(prompt_ids, params,
                             lambda o: loop.call_soon_threadsafe(queue.put_nowait, o))
    except PromptTooLong as e:
      raise ApiError(400, str(e), param="messages" if chat else "prompt",
                     code="context_length_exceeded") from e
    except ValueError as e:
      raise ApiError(400, str(e), param=_field_in(str(e))) from e
    resp = protocol.Response(model_name, chat)
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
    extra = {"pool_fraction": out.pool_fraction} if out.pool_fraction is not None else None
    return resp.full("".join(parts), out.finish_reason, out.prompt_tokens,
                     out.completion_tokens, extra)

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
          yield _event(resp.chunk(None if resp.chat else "", out.finish_reason))
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


def _event(obj: dict) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _field_in(message: str) -> str | None:
  """The sampling field a pigjax validation message names (its first word)."""
  word = message.split(" ", 1)[0]
  return {"max_new_tokens": "max_tokens"}.get(word, word) if word.isidentifier() else None
