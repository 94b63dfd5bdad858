"""The OpenAI-compatible HTTP layer (FastAPI): /v1/models, /v1/completions, /v1/chat/completions,
/health. It parses and validates requests, submits them to a `Scheduler` running on its own
thread, and forwards each request's outputs, as server-sent events when `stream` is true.

A client that disconnects cancels its request, so its row is freed for the next one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pigjax.serving import protocol
from pigjax.serving.protocol import ApiError
from pigjax.serving.scheduler import Output, PromptTooLong, Scheduler


def create_app(scheduler: Scheduler, tokenizer, model_name: str, attention: str,
               default_max_tokens: int) -> FastAPI:
  """The FastAPI app over a started scheduler (`Scheduler.start`)."""
  app = FastAPI(title="pigjax", docs_url=None, redoc_url=None)
  created = int(time.time())

  @app.exception_handler(ApiError)
  async def _api_error(_, e: ApiError):
    return JSONResponse(e.body(), status_code=e.status)

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
    body = await _json_body(request)
    protocol.check_model(body, model_name)
    prompt_ids = tokenizer.encode(protocol.completion_prompt(body))
    return await _generate(request, body, prompt_ids, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    body = await _json_body(request)
    protocol.check_model(body, model_name)
    messages = protocol.chat_messages(body)
    try:
      text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:
      raise ApiError(400, f"The chat template could not render these messages: {e}",
                     param="messages") from e
    return await _generate(request, body, tokenizer.encode(text), chat=True)

  async def _generate(request: Request, body: dict, prompt_ids: list[int], chat: bool):
    params = protocol.parse_params(body, default_max_tokens)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
      raise ApiError(400, "'stream' must be true or false.", param="stream")
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
    try:
      while True:
        try:
          out = await asyncio.wait_for(queue.get(), timeout=1.0)
        except asyncio.TimeoutError:
          if await request.is_disconnected():
            scheduler.cancel(rid)
            return JSONResponse({}, status_code=499)
          continue
        parts.append(out.text)
        if out.finish_reason is not None:
          break
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


async def _json_body(request: Request) -> dict:
  raw = await request.body()
  try:
    body = json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ApiError(400, f"The request body is not valid JSON ({e}).") from e
  if not isinstance(body, dict):
    raise ApiError(400, "The request body must be a JSON object.")
  return body


def _event(obj: dict) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _field_in(message: str) -> str | None:
  """The sampling field a pigjax validation message names (its first word)."""
  word = message.split(" ", 1)[0]
  return {"max_new_tokens": "max_tokens"}.get(word, word) if word.isidentifier() else None
