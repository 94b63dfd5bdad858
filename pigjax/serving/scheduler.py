"""Continuous batching: requests join free rows between decode steps and leave as soon as they end.

Each `step()` does, in order (docs/serving.md):
  1. drop cancelled requests (their rows are free at once);
  2. if no prefill is in progress and a row is free, start prefilling the oldest waiting request
     alone (batch 1);
  3. run ONE chunk of that prefill; when its prompt is done, put it into its row and sample its
     first token;
  4. run one decode step of every row holding a request.
So a long prompt is read a chunk at a time while the running rows keep producing a token per
step. Nothing here knows about HTTP: `pigjax.serving.server` submits requests and forwards each
`Output` to its client, and the tests drive `step()` directly.

Per-request text is produced on the host: new ids are decoded incrementally, stop ids and stop
strings end a request (`sampling.StopChecker`), and text that could be the start of a stop string
is held back until it is known not to be one.

A request may carry a deadline (`submit(..., deadline=)`, on the `time.monotonic()` clock): once
it passes, the request ends with finish_reason "timeout" wherever it is (waiting, prefilling or
decoding), with the text it has, and its row is freed. The waiting queue may be bounded
(`max_waiting`): a submit past it raises `QueueFull`.

Faults stay with the request that caused them: an exception while one request is prefilled,
admitted or has its token post-processed ends that request alone with finish_reason "error".
Only a failure of the shared decode step ends every running row (each with an error Output);
the running cache is then rebuilt, and waiting requests are served as usual. Every submitted
request gets exactly one final Output.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import random
import threading
import time
from typing import Callable, Sequence

import numpy as np

from pigjax import sampling
from pigjax.serving.batch import Prefill, SlotBatch, needs_full_sampler

log = logging.getLogger("pigjax.serving")


@dataclasses.dataclass(frozen=True)
class RequestParams:
  """One request's generation settings (the OpenAI request fields, validated by the caller)."""
  max_tokens: int = 16
  temperature: float = 0.0  # 0 = greedy
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  seed: int | None = None  # None: a random seed
  stop: tuple[str, ...] = ()
  ignore_eos: bool = False  # keep going past end-of-sequence ids (benchmarks)

  def validate(self) -> None:
    """Raises ValueError naming the first bad field (OpenAI's names).

    Beyond each field's meaning, every value must fit the [B] operands it is copied into
    (int32 counts, float32 settings), so a bad value fails its own submit, never a decode step.
    """
    for name in ("max_tokens", "top_k"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or not -2**31 <= v < 2**31:
        raise ValueError(f"{name} must be an integer that fits int32, got {v!r}.")
    if self.max_tokens < 1:
      raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}.")
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
          abs(v) > sampling.FLOAT32_MAX:
        raise ValueError(f"{name} must be a finite number, got {v!r}.")
    if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
      raise ValueError(f"seed must be an integer or None, got {self.seed!r}.")
    if not (isinstance(self.stop, tuple) and all(isinstance(x, str) for x in self.stop)):
      raise ValueError(f"stop must be a tuple of strings, got {self.stop!r}.")
    if not isinstance(self.ignore_eos, bool):
      raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}.")
    sampling.validate_sampling(self.temperature, self.top_k, self.top_p, self.min_p,
                               self.repetition_penalty)


class PromptTooLong(ValueError):
  """The prompt plus max_tokens does not fit in a row's context."""


class QueueFull(RuntimeError):
  """`max_waiting` requests are already waiting for a row."""


@dataclasses.dataclass
class Output:
  """What a request produced since its previous Output."""
  request_id: str
  text: str  # new text (stop strings and what follows them are never included)
  token_ids: list[int]  # new generated ids
  finish_reason: str | None = None  # "stop" | "length" | "timeout" | "cancelled" | "error"
  prompt_tokens: int = 0
  completion_tokens: int = 0  # generated so far
  pool_fraction: float | None = None  # MagicPIG: share of the pool attended (on finish)
  error: str | None = None


@dataclasses.dataclass
class _Request:
  id: str
  prompt_ids: list[int]
  params: RequestParams
  on_output: Callable[[Output], None]
  seed: int
  checker: sampling.StopChecker
  deadline: float | None = None  # time.monotonic() past which the request ends
  new_ids: list[int] = dataclasses.field(default_factory=list)
  text: str = ""  # the text of new_ids (stop strings cut), as far as sent or held back
  sent_chars: int = 0
  slot: int = -1


class Scheduler:
  """Admits, steps and finishes requests over a `SlotBatch`.

  Thread-safe entry points: `submit`, `cancel`. Everything else runs on one thread (the
  `run_forever` loop, or the caller's when it calls `step` directly).

  Args:
    batch: the device rows.
    tokenizer: decodes ids (and gives stop ids).
    context_limit: most prompt + generated tokens per request.
    max_waiting: most requests waiting for a row (a submit past it raises QueueFull); 0: no
      bound.
  """

  def __init__(self, batch: SlotBatch, tokenizer, context_limit: int, max_waiting: int = 0):
    self.batch = batch
    self.tokenizer = tokenizer
    self.context_limit = min(context_limit, batch.cache_len)
    self.max_waiting = max_waiting
    B = batch.slots
    self._lock = threading.Condition()
    self._waiting: collections.deque[_Request] = collections.deque()
    self._cancelled: set[str] = set()
    self._rows: list[_Request | None] = [None] * B  # decoding rows
    self._prefill: tuple[_Request, Prefill] | None = None
    self._ids = itertools.count()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    # Per-row host state uploaded every step (small); idle rows keep neutral settings.
    self._tokens_B = np.zeros(B, np.int32)
    self._seeds_B = np.zeros(B, np.int32)
    self._counters_B = np.zeros(B, np.int32)
    self._history_BS = np.full((B, batch.cache_len), -1, np.int32)
    self._params: list[RequestParams] = [RequestParams()] * B
    self.steps = 0  # decode steps run (for tests and stats)
    self.finished: collections.Counter[str] = collections.Counter()  # requests by finish reason

  # -- thread-safe API ----------------------------------------------------------------------

  def submit(self, prompt_ids: Sequence[int], params: RequestParams,
             on_output: Callable[[Output], None], deadline: float | None = None) -> str:
    """Queues a request; `on_output` is called (from the scheduler thread) with its outputs.

    Args:
      deadline: a `time.monotonic()` time; when it passes the request ends with finish_reason
        "timeout" (None: no deadline).
    Raises:
      ValueError naming a bad field; PromptTooLong when prompt + max_tokens exceeds the context;
      QueueFull when `max_waiting` requests are waiting.
    """
    params.validate()
    if deadline is not None and (isinstance(deadline, bool) or
                                 not isinstance(deadline, (int, float)) or deadline != deadline):
      raise ValueError(f"deadline must be a time.monotonic() time or None, got {deadline!r}.")
    n = len(prompt_ids)
    if n < 1:
      raise ValueError("The prompt is empty: it needs at least one token.")
    if n + params.max_tokens > self.context_limit:
      raise PromptTooLong(
          f"This model's context is {self.context_limit} tokens; the prompt has {n} tokens and "
          f"max_tokens is {params.max_tokens}. Shorten the prompt or lower max_tokens.")
    seed = params.seed if params.seed is not None else random.randrange(2**31)
    req = _Request(id=f"req-{next(self._ids)}", prompt_ids=list(prompt_ids), params=params,
                   on_output=on_output, seed=int(seed) % 2**31,
                   checker=sampling.StopChecker(() if params.ignore_eos else self.tokenizer.stop_ids, params.stop,
                                                self.tokenizer), deadline=deadline)
    with self._lock:
      if self.max_waiting and len(self._waiting) >= self.max_waiting:
        raise QueueFull(f"{len(self._waiting)} requests are already waiting for a row (the "
                        f"server's limit, serve.max_waiting); retry shortly.")
      self._waiting.append(req)
      self._lock.notify()
    return req.id

  def cancel(self, request_id: str) -> None:
    """Ends a request (waiting, prefilling or decoding); its row is freed on the next step."""
    with self._lock:
      self._cancelled.add(request_id)
      self._lock.notify()

  # -- state --------------------------------------------------------------------------------

  @property
  def num_running(self) -> int:
    return sum(r is not None for r in self._rows)

  @property
  def num_waiting(self) -> int:
    return len(self._waiting) + (self._prefill is not None)

  def has_work(self) -> bool:
    return bool(self._waiting or self._prefill or self.num_running or self._cancelled)

  def _free_slot(self) -> int | None:
    reserved = self._prefill[0].slot if self._prefill else -1
    return next((b for b, r in enumerate(self._rows) if r is None and b != reserved), None)

  # -- the loop -----------------------------------------------------------------------------

  def step(self) -> bool:
    """One scheduling round (see the module docstring). Returns whether it did any work."""
    did = self._drop_cancelled()
    did = self._drop_expired() or did
    if self._prefill is None:
      with self._lock:
        slot = self._free_slot() if self._waiting else None
        req = self._waiting.popleft() if slot is not None else None
      if req is not None:
        req.slot = slot
        try:
          self._prefill = (req, self.batch.start_prefill(req.prompt_ids))
        except Exception as e:
          self._fail_request(req, e, "prefill")
        did = True
    if self._prefill is not None:
      req, p = self._prefill
      try:
        self.batch.prefill_chunk(p)
        if p.finished:
          self._prefill = None
          self._admit(req, p)
      except Exception as e:
        self._prefill = None
        self._fail_request(req, e, "admission")
      did = True
    if self.num_running:
      try:
        self._decode()
      except Exception as e:  # the shared step: every running row is lost, the server is not
        log.exception("decode step failed")
        self._fail_running(f"{type(e).__name__}: {e}")
      did = True
    return did

  def run_until_idle(self, max_steps: int = 100_000) -> None:
    """Steps until nothing is waiting or running (tests, scripts)."""
    for _ in range(max_steps):
      if not self.has_work():
        return
      self.step()
    raise RuntimeError(f"The scheduler was still busy after {max_steps} steps.")

  def run_forever(self) -> None:
    """The serving loop: steps while there is work, sleeps until a submit or cancel."""
    while not self._stop.is_set():
      with self._lock:
        while not self.has_work() and not self._stop.is_set():
          self._lock.wait()
      if self._stop.is_set():
        break
      try:
        self.step()
      except Exception as e:  # a bug outside the guarded stages: keep serving all the same
        log.exception("scheduler step failed")
        if self._prefill is not None:
          req, self._prefill = self._prefill[0], None
          self._fail_request(req, e, "scheduling")
        self._fail_running(f"{type(e).__name__}: {e}")

  def start(self) -> None:
    self._thread = threading.Thread(target=self.run_forever, name="pigjax-scheduler",
                                    daemon=True)
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    with self._lock:
      self._lock.notify()
    if self._thread is not None:
      self._thread.join()

  # -- internals ----------------------------------------------------------------------------

  def _drop_cancelled(self) -> bool:
    with self._lock:
      cancelled, self._cancelled = self._cancelled, set()
      if not cancelled:
        return False
      for req in [r for r in self._waiting if r.id in cancelled]:
        self._waiting.remove(req)
        self._emit(req, "", [], "cancelled")
    if self._prefill is not None and self._prefill[0].id in cancelled:
      self._emit(self._prefill[0], "", [], "cancelled")
      self._prefill = None
    for req in list(self._rows):
      if req is not None and req.id in cancelled:
        try:
          self._finish(req, "", "cancelled")
        except Exception as e:
          self._fail_request(req, e, "cancellation")
    return True

  def _drop_expired(self) -> bool:
    """Ends every request whose deadline has passed (finish_reason "timeout")."""
    now = time.monotonic()
    late = lambda r: r.deadline is not None and now >= r.deadline
    with self._lock:
      expired = [r for r in self._waiting if late(r)]
      for req in expired:
        self._waiting.remove(req)
    for req in expired:
      self._emit(req, "", [], "timeout")
    if self._prefill is not None and late(self._prefill[0]):
      req, self._prefill = self._prefill[0], None
      self._emit(req, "", [], "timeout")
      expired.append(req)
    for req in list(self._rows):
      if req is not None and late(req):
        expired.append(req)
        try:
          self._finish(req, req.text, "timeout")
        except Exception as e:
          self._fail_request(req, e, "timeout")
    return bool(expired)

  def _admit(self, req: _Request, p: Prefill) -> None:
    b, prm = req.slot, req.params
    hist = np.full(self.batch.cache_len, -1, np.int32)
    hist[:len(req.prompt_ids)] = req.prompt_ids
    first = self.batch.admit(p, b, prm, req.seed, hist)
    self._rows[b] = req
    self._params[b] = prm
    self._seeds_B[b] = req.seed
    self._counters_B[b] = 1
    self._history_BS[b] = hist
    self._on_token(req, first)

  def _decode(self) -> None:
    active_B = np.array([r is not None for r in self._rows])
    rows = sampling.RowSampling.from_rows(self._params)
    full = needs_full_sampler([r.params for r in self._rows if r is not None])
    next_B = self.batch.step(self._tokens_B, self._seeds_B, self._counters_B, rows,
                             self._history_BS if full else None, active_B)
    self.steps += 1
    for b, req in enumerate(self._rows):
      if req is not None:
        self._counters_B[b] += 1
        try:
          self._on_token(req, int(next_B[b]))
        except Exception as e:  # e.g. its stop check: this row's fault, not its neighbours'
          self._fail_request(req, e, "decoding")

  def _on_token(self, req: _Request, tok: int) -> None:
    b = req.slot
    req.new_ids.append(tok)
    self._tokens_B[b] = tok
    n = len(req.prompt_ids) + len(req.new_ids)
    if n - 1 < self._history_BS.shape[1]:
      self._history_BS[b, n - 1] = tok
    status = req.checker.check(req.new_ids)
    req.text = status.text
    if status.stopped:
      self._finish(req, status.text, "stop")
    elif len(req.new_ids) >= req.params.max_tokens or n >= self.context_limit:
      self._finish(req, status.text, "length")
    else:
      safe = _safe_prefix(status.text, req.params.stop)
      self._emit(req, safe[req.sent_chars:], [tok], None)
      req.sent_chars = max(req.sent_chars, len(safe))

  def _finish(self, req: _Request, text: str, reason: str) -> None:
    b = req.slot
    pool_fraction = None
    stats = self.batch.row_stats()
    if "pool_total_B" in stats and stats["pool_total_B"][b] > 0:
      pool_fraction = float(stats["cand_total_B"][b] / stats["pool_total_B"][b])
    self._rows[b] = None
    self._params[b] = RequestParams()
    self._history_BS[b] = -1
    self.batch.free(b)
    last = req.new_ids[-1:] if reason not in ("cancelled", "timeout") else []  # else sent
    self._emit(req, text[req.sent_chars:], last, reason, pool_fraction)

  def _emit(self, req: _Request, text: str, ids: list[int], reason: str | None,
            pool_fraction: float | None = None) -> None:
    if reason is not None:
      self.finished[reason] += 1
    try:
      req.on_output(Output(req.id, text, ids, reason, len(req.prompt_ids), len(req.new_ids),
                           pool_fraction))
    except Exception:  # a broken consumer must not stop the other requests
      log.exception("output callback failed for %s", req.id)

  def _release(self, req: _Request) -> None:
    """Takes `req` out of its row (if it holds one) and resets the row's host state."""
    b = req.slot
    if 0 <= b < len(self._rows) and self._rows[b] is req:
      self._rows[b] = None
    if 0 <= b < len(self._rows) and self._rows[b] is None:
      self._params[b] = RequestParams()
      self._history_BS[b] = -1
      self._tokens_B[b] = 0

  def _fail_request(self, req: _Request, error: Exception, stage: str) -> None:
    """Ends one request with an error Output; its row (if any) is freed for the next request."""
    log.error("request %s failed during %s", req.id, stage, exc_info=error)
    self._release(req)
    if 0 <= req.slot < len(self._rows) and self._rows[req.slot] is None:
      try:  # a half-done admission may have written the row's host-store slot
        self.batch.free(req.slot)
      except Exception:
        log.exception("freeing row %d after %s failed", req.slot, req.id)
    self._emit_error(req, f"{type(error).__name__}: {error}")

  def _fail_running(self, message: str) -> None:
    """Ends every running request with an error Output and rebuilds the running cache, whose
    buffers a failed step may have consumed (it donates them). A request being prefilled keeps
    its own cache and goes on."""
    reqs = [r for r in self._rows if r is not None]
    for req in reqs:
      self._release(req)
    try:
      self.batch.reset()
    except Exception:
      log.exception("rebuilding the running cache failed")
    for req in reqs:
      self._emit_error(req, message)

  def _emit_error(self, req: _Request, message: str) -> None:
    self.finished["error"] += 1
    try:
      req.on_output(Output(req.id, "", [], "error", len(req.prompt_ids), len(req.new_ids),
                           error=message))
    except Exception:
      log.exception("output callback failed for %s", req.id)


def _safe_prefix(text: str, stops: Sequence[str]) -> str:
  """`text` without a trailing incomplete character or a trailing partial stop string."""
  text = text.rstrip("\ufffd")
  hold = 0
  for s in stops:
    for k in range(min(len(s) - 1, len(text)), hold, -1):
      if text.endswith(s[:k]):
        hold = k
        break
  return text[:len(text) - hold]
