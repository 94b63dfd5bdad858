"""What an operator relies on, against the real `python -m pigjax.serve` on 127.0.0.1 with the
official `openai` client (tiny checkpoint): API keys (401 in OpenAI's format, /health open), the
request limits (400 naming the field), a bounded queue (429 with Retry-After, then service goes
on), deadlines that free their rows, /metrics in the Prometheus text format, one access-log line
per request, and SIGTERM draining running streams before exiting 0."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import tiny_checkpoint
from test_server import MODEL, REPO, SLOTS, Server, _user_env

CONTEXT = 2048
KEYS = ("key-one", "key-two", "key-three")
MAX_WAITING = 16  # no 429 for the load test's 16 clients (rows take 4 of them)
MAX_TOKENS = 1900
LONG = 1800  # tokens of a stream that outlasts the test's checks by seconds


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  d = tmp_path_factory.mktemp("tiny")
  tiny_checkpoint.write_tiny_llama(d, max_position=CONTEXT)
  return d


def _args(*extra):
  return [f"--config.max_seq_len={CONTEXT}", *extra]


@pytest.fixture(scope="module")
def servers(ckpt):
  """Three servers started together (their compiles overlap): `ops` has keys and tight limits;
  `drain` (MagicPIG) and `cut` (a 1 s grace, prompts logged) are each stopped by one test."""
  started = {
      "ops": Server(ckpt, "dense", ckpt / "ops.log", extra_args=_args(
          f"--api_key={KEYS[0]}", f"--api_key={KEYS[1]},{KEYS[2]}",
          f"--config.serve.max_waiting={MAX_WAITING}",
          f"--config.serve.max_tokens_limit={MAX_TOKENS}", "--config.serve.max_messages=3",
          "--config.serve.max_stop_strings=2", "--config.serve.max_stop_chars=8")),
      "drain": Server(ckpt, "magicpig", ckpt / "drain.log", extra_args=_args(
          f"--api_key={KEYS[0]}")),
      "cut": Server(ckpt, "dense", ckpt / "cut.log", extra_args=_args(
          "--config.serve.shutdown_grace_s=1", "--config.serve.log_prompts=true")),
  }
  try:
    yield {k: s.wait_ready() for k, s in started.items()}
  finally:
    for s in started.values():
      s.stop()


def _client(server, key=KEYS[0]) -> openai.OpenAI:
  return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _auth(key=KEYS[0]) -> dict:
  return {"Authorization": f"Bearer {key}"}


def _error(r, status: int) -> dict:
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert set(err) == {"message", "type", "param", "code"}, err
  return err


def _long_stream(client, prompt="Hi", max_tokens=LONG, extra=None, **kw):
  return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                   temperature=0, stream=True,
                                   extra_body={"ignore_eos": True, **(extra or {})}, **kw)


def _wait_idle(server, within=5.0) -> dict:
  end = time.monotonic() + within
  while True:
    h = server.health()
    if (h["running"] == 0 and h["waiting"] == 0) or time.monotonic() > end:
      return h
    time.sleep(0.05)


def _metrics(server, key=KEYS[0]) -> dict:
  """Every sample of /metrics as {(name, sorted labels): value}."""
  r = httpx.get(server.url + "/metrics", headers=_auth(key) if key else {}, timeout=10)
  assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_keys_guard_every_route_but_health(servers):
  server = servers["ops"]
  for key in KEYS:  # repeated flags and comma-separated keys all count
    done = _client(server, key).completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                                   temperature=0)
    assert done.usage.completion_tokens >= 1
  with pytest.raises(openai.AuthenticationError):
    _client(server, "key-four").models.list()
  for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Basic " + KEYS[0]},
                  {"Authorization": f"Bearer {KEYS[0]}x"}, _auth(KEYS[0][:-1])):
    for path in ("/v1/models", "/v1/completions", "/metrics", "/openapi.json", "/docs", "/nope"):
      r = httpx.request("POST" if path == "/v1/completions" else "GET", server.url + path,
                        headers=headers, json={"model": MODEL, "prompt": "Hi"}, timeout=10)
      err = _error(r, 401)
      assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
  assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
  assert httpx.get(server.url + "/openapi.json", headers=_auth(), timeout=10).status_code == 404
  log = server.log.read_text()
  assert not any(k in log for k in KEYS), "an API key reached the log"
  # The keyless server keeps its schema public and takes any Authorization.
  assert httpx.get(servers["cut"].url + "/openapi.json", timeout=10).status_code == 200
  assert [m.id for m in _client(servers["cut"], "anything").models.list().data] == [MODEL]


@pytest.mark.parametrize("body, param, setting", [
    ({"max_tokens": MAX_TOKENS + 1}, "max_tokens", "max_tokens_limit"),
    ({"max_completion_tokens": MAX_TOKENS + 1}, "max_completion_tokens", "max_tokens_limit"),
    ({"stop": ["a", "b", "c"]}, "stop", "max_stop_strings"),
    ({"stop": "123456789"}, "stop", "max_stop_chars"),
    ({"messages": [{"role": "user", "content": "hi"}] * 4}, "messages", "max_messages"),
    ({"timeout": 0}, "timeout", None),
    ({"timeout": -1}, "timeout", None),
    ({"timeout": "5"}, "timeout", None),
    ({"timeout": 1e8}, "timeout", None),
])
def test_limits_get_400_naming_the_field(servers, body, param, setting):
  chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
  r = httpx.post(servers["ops"].url + "/v1/chat/completions", headers=_auth(), timeout=10,
                 json=chat | body)
  err = _error(r, 400)
  assert err["param"] == param and param in err["message"], err
  assert setting is None or setting in err["message"], err


def test_a_full_queue_gets_429_and_service_resumes(servers):
  server = servers["ops"]
  client = _client(server)
  running = [_long_stream(client, f"busy {i}") for i in range(SLOTS)]
  for s in running:
    next(s)  # admitted: every row is busy
  waiting = [_long_stream(client, f"wait {i}", max_tokens=4) for i in range(MAX_WAITING)]
  assert server.health()["waiting"] == MAX_WAITING
  r = httpx.post(server.url + "/v1/completions", headers=_auth(), timeout=10,
                 json={"model": MODEL, "prompt": "one too many", "max_tokens": 2})
  err = _error(r, 429)
  assert err["code"] == "rate_limit_exceeded" and "max_waiting" in err["message"], err
  assert int(r.headers["retry-after"]) >= 1
  with pytest.raises(openai.RateLimitError):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
  for s in running:
    s.close()  # frees the rows: the waiting ones run, and new requests are taken again
  for s in waiting:
    assert [c.choices[0].finish_reason for c in s][-1] == "length"
  done = client.completions.create(model=MODEL, prompt="after", max_tokens=3, temperature=0,
                                   extra_body={"ignore_eos": True})
  assert done.usage.completion_tokens == 3
  h = _wait_idle(server)
  assert h["running"] == 0 and h["waiting"] == 0, h


def test_a_deadline_ends_the_request_and_frees_its_row(servers):
  """`timeout` (seconds from arrival) ends a request that would run for many seconds with
  finish_reason "length" and the text so far, streaming or not; its row is free at once."""
  server = servers["ops"]
  client = _client(server)
  before = server.health()["finished"].get("timeout", 0)
  start = time.monotonic()
  full = client.completions.create(model=MODEL, prompt="Hi", max_tokens=MAX_TOKENS,
                                   temperature=0, extra_body={"ignore_eos": True, "timeout": 0.5})
  took = time.monotonic() - start
  assert full.choices[0].finish_reason == "length" and full.model_extra["pigjax"]["timed_out"]
  assert 1 <= full.usage.completion_tokens < MAX_TOKENS and 0.5 <= took < 5, (full.usage, took)
  chunks = list(_long_stream(client, max_tokens=MAX_TOKENS, extra={"timeout": 0.5},
                             stream_options={"include_usage": True}))
  finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
  assert [c.choices[0].finish_reason for c in finals] == ["length"]
  assert finals[0].model_extra["pigjax"] == {"timed_out": True}
  assert chunks[-1].usage.completion_tokens < MAX_TOKENS
  h = _wait_idle(server, within=1.0)
  assert h["running"] == 0 and h["waiting"] == 0, h
  assert h["finished"]["timeout"] == before + 2


def test_metrics_count_requests_tokens_and_latencies(servers):
  server = servers["ops"]
  client = _client(server)
  key = lambda name, **labels: (name, tuple(sorted(labels.items())))
  ok = key("pigjax_requests_total", endpoint="/v1/completions", status="200")
  before = _metrics(server)
  assert before[key("pigjax_slots")] == SLOTS and before[key("pigjax_num_requests_running")] == 0
  assert before[key("pigjax_num_requests_waiting")] == 0
  assert not any(k[0].startswith("pigjax_host_store") for k in before)  # dense: no host store
  comp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                   temperature=0, extra_body={"ignore_eos": True})
  chunks = list(_long_stream(client, max_tokens=6, stream_options={"include_usage": True}))
  with pytest.raises(openai.BadRequestError):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=0)
  after = _metrics(server)
  delta = lambda k: after.get(k, 0) - before.get(k, 0)
  assert delta(ok) == 2
  assert delta(key("pigjax_requests_total", endpoint="/v1/completions", status="400")) == 1
  assert delta(key("pigjax_prompt_tokens_total")) == (comp.usage.prompt_tokens +
                                                      chunks[-1].usage.prompt_tokens)
  assert delta(key("pigjax_generation_tokens_total")) == 8 + 6
  assert delta(key("pigjax_request_finished_total", finish_reason="length")) == 2
  assert delta(key("pigjax_time_to_first_token_seconds_count")) == 2
  assert delta(key("pigjax_inter_token_latency_seconds_count")) == 7 + 5
  assert delta(key("pigjax_request_latency_seconds_count", endpoint="/v1/completions")) == 3
  assert delta(key("pigjax_time_to_first_token_seconds_sum")) > 0
  # One access-log line per request, with its id and token counts, and no prompt text.
  log = server.log.read_text().splitlines()
  [line] = [l for l in log if comp.id in l]
  assert " 200 " in line and "completion_tokens=8" in line and "latency_ms=" in line, line
  assert "Once upon a time" not in "\n".join(log)


def test_sigterm_lets_two_streams_finish_then_exits_0(servers):
  """MagicPIG: /metrics shows the host store; on SIGTERM new requests get 503 (OpenAI's
  format) while the two running streams go on to their last token, then the server exits 0."""
  server = servers["drain"]
  client = _client(server)
  client.completions.create(model=MODEL, prompt="The quick brown fox " * 8, max_tokens=8,
                           temperature=0)
  m = _metrics(server)
  assert m[("pigjax_host_store_bytes", ())] > 0
  assert m[("pigjax_attended_fraction_count", ())] == 1
  assert 0 < m[("pigjax_attended_fraction_sum", ())] <= 1
  n = 120
  streams = [client.completions.create(
      model=MODEL, prompt=p, max_tokens=n, temperature=0, stream=True,
      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
      for p in ("first stream", "second stream")]
  heads = [next(s) for s in streams]
  assert server.health()["running"] == 2 and all(h.choices for h in heads)
  server.proc.send_signal(signal.SIGTERM)
  end = time.monotonic() + 5
  while True:
    r = httpx.get(server.url + "/v1/models", headers=_auth(), timeout=5)
    if r.status_code == 503 or time.monotonic() > end:
      break
    time.sleep(0.02)
  err = _error(r, 503)
  assert err["code"] == "server_shutting_down", err
  assert httpx.get(server.url + "/health", timeout=5).json()["status"] == "draining"
  with pytest.raises(openai.InternalServerError):  # 503
    client.completions.create(model=MODEL, prompt="late", max_tokens=2)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    rests = list(pool.map(list, streams))
  for rest in rests:
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    assert rest[-1].usage.completion_tokens == n
  assert server.proc.wait(30) == 0, server.log.read_text()[-2000:]
  assert "draining (2 requests in flight" in server.log.read_text()


def test_a_stream_past_the_grace_period_is_cut_and_the_exit_is_0(servers):
  server = servers["cut"]
  client = _client(server, "any")
  stream = _long_stream(client, "logged prompt text", max_tokens=CONTEXT - 64)
  next(stream)
  start = time.monotonic()
  server.proc.send_signal(signal.SIGTERM)
  with pytest.raises((httpx.HTTPError, openai.APIError)):
    for _ in stream:  # the server ends the connection once the 1 s grace is over
      pass
  assert server.proc.wait(30) == 0, server.log.read_text()[-2000:]
  assert time.monotonic() - start < 15
  log = server.log.read_text()
  assert "still running after serve.shutdown_grace_s" in log, log[-2000:]
  assert 'prompt="logged prompt text"' in log, log[-2000:]  # serve.log_prompts


def test_bad_serve_settings_stop_the_start_in_one_line(ckpt):
  for arg, named in [("--config.serve.request_timeout=-2.0", "serve.request_timeout")]:
    out = subprocess.run([sys.executable, "-m", "pigjax.serve", "--config=configs/tiny.py",
                          f"--config.checkpoint={ckpt}", "--compilation_cache=", "--port=1",
                          arg], cwd=REPO, capture_output=True, text=True, env=_user_env(),
                         timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and named in lines[0], out.stderr


LOAD_REQUESTS, LOAD_CLIENTS = 200, 16


def _rss_kib(pid: int) -> int:
  with open(f"/proc/{pid}/status") as f:
    return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from /proc")
def test_load_of_200_requests_from_16_clients(servers):
  """200 greedy requests (completions and chat, streaming and not) from 16 clients at once: no
  5xx, each answer equal to the same request run alone, every row free after, and the server's
  RSS within 5% of what it was after a warm-up round."""
  server = servers["ops"]
  client = _client(server)
  kinds = [(f"Request {i}: " + "la " * (i % 7), i % 4) for i in range(20)]

  def ask(spec):
    prompt, kind = spec
    kw = dict(model=MODEL, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    if kind in (0, 1):
      stream = kind == 1
      r = client.completions.create(prompt=prompt, stream=stream, **kw)
      return "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
    messages = [{"role": "user", "content": prompt}]
    stream = kind == 3
    r = client.chat.completions.create(messages=messages, stream=stream, **kw)
    return ("".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream else
            r.choices[0].message.content)

  alone = {spec: ask(spec) for spec in kinds}
  with concurrent.futures.ThreadPoolExecutor(LOAD_CLIENTS) as pool:
    list(pool.map(ask, kinds * 2))  # warm-up: the server's pools and buffers at full load
    rss_before = _rss_kib(server.proc.pid)
    specs = [kinds[i % len(kinds)] for i in range(LOAD_REQUESTS)]
    start = time.monotonic()
    answers = list(pool.map(ask, specs))  # an APIStatusError (any 4xx / 5xx) fails the test
    took = time.monotonic() - start
  assert answers == [alone[s] for s in specs]
  h = _wait_idle(server)
  assert h["running"] == 0 and h["waiting"] == 0, h
  m = _metrics(server)
  statuses = {dict(k[1])["status"] for k in m if k[0] == "pigjax_requests_total"}
  assert not any(s.startswith("5") for s in statuses), statuses
  rss_after = _rss_kib(server.proc.pid)
  assert abs(rss_after - rss_before) <= 0.05 * rss_before, (rss_before, rss_after, took)
