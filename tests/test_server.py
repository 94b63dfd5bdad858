"""The server the way users use it: `python -m pigjax.serve` in a subprocess on a free port and
the official `openai` client (dense and MagicPIG servers on a tiny random checkpoint)."""

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

import tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny"
SLOTS = 4


def _user_env() -> dict:
  """The environment without JAX_PLATFORMS, as users start the server: jax probes its backends
  (and on a GPU machine defaults to the GPU, so MagicPIG must move itself to the CPU)."""
  return {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Server:
  def __init__(self, ckpt: Path, kind: str, log: Path, extra_args=(), port=None):
    self.port = port or _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.log = log
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "pigjax.serve", "--config=configs/tiny.py",
         f"--config.checkpoint={ckpt}", f"--config.attention.kind={kind}",
         f"--config.serve.slots={SLOTS}", f"--config.serve.model_name={MODEL}",
         "--compilation_cache=", f"--port={self.port}", *extra_args],
        cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, env=_user_env())

  def wait_ready(self, timeout=600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        raise AssertionError(f"server exited:\n{self.log.read_text()[-3000:]}")
      try:
        if httpx.get(self.url + "/health", timeout=2).status_code == 200:
          return self
      except httpx.HTTPError:
        pass
      time.sleep(0.5)
    raise AssertionError(f"server not ready:\n{self.log.read_text()[-3000:]}")

  def client(self) -> openai.OpenAI:
    return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

  def health(self) -> dict:
    return httpx.get(self.url + "/health").json()

  def stop(self):
    self.proc.terminate()
    try:
      self.proc.wait(20)
    except subprocess.TimeoutExpired:
      self.proc.kill()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
  """Both servers start together (their start-up compiles overlap) and serve the module."""
  d = tmp_path_factory.mktemp("tiny")
  tiny_checkpoint.write_tiny_llama(d)
  started = {k: Server(d, k, d / f"{k}.log") for k in ("dense", "magicpig")}
  try:
    yield {k: s.wait_ready() for k, s in started.items()}
  finally:
    for s in started.values():
      s.stop()


PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 2, "Hi", "Once upon a time",
           "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12"]


def stream_text(client, prompt, max_tokens=24, **kw):
  stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, stream=True,
                                     extra_body={"ignore_eos": True}, **kw)
  return "".join(c.choices[0].text for c in stream if c.choices)


def test_startup_says_where_it_listens_and_nothing_else(servers):
  for server in servers.values():
    log = server.log.read_text()
    assert f"on http://127.0.0.1:{server.port}/v1" in log
    # absl would print jax's backend probing ("Unable to initialize backend 'tpu'") at INFO.
    assert "Unable to initialize backend" not in log and "xla_bridge" not in log, log


def test_serve_reports_user_errors_in_one_line(tmp_path):
  for args, named in [(["--config.checkpoint=/nonexistent/ckpt"], "/nonexistent/ckpt"),
                      (["--config.attention.sink=-1"], "attention.sink"),
                      (["--config.serve.no_such_key=1"], "no_such_key")]:
    out = subprocess.run([sys.executable, "-m", "pigjax.serve", "--config=configs/tiny.py",
                          "--config.checkpoint=x", *args], cwd=REPO, capture_output=True,
                         text=True, env=_user_env(), timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines[-1].startswith("pigjax: error: "), out.stderr
    assert named in lines[-1] and "Traceback" not in out.stderr, out.stderr


def test_chat_and_completions_stream_and_not(servers):
  client = servers["dense"].client()
  assert [m.id for m in client.models.list().data] == [MODEL]
  messages = [{"role": "user", "content": "What is the capital of France?"}]
  full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                        temperature=0)
  choice = full.choices[0]
  assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
  assert 1 <= full.usage.completion_tokens <= 12
  assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
  chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                               temperature=0, stream=True,
                                               stream_options={"include_usage": True}))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
      choice.message.content
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
      full.usage.completion_tokens

  comp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10,
                                   temperature=0, extra_body={"ignore_eos": True})
  assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 10
  assert stream_text(client, "Once upon a time", max_tokens=10) == comp.choices[0].text
  # Raw SSE: events end with [DONE]; without include_usage there is no usage chunk.
  with httpx.stream("POST", servers["dense"].url + "/v1/completions", json={
      "model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}, timeout=300) as r:
    lines = [l for l in r.iter_lines() if l]
  assert lines[-1] == "data: [DONE]"
  events = [json.loads(l[len("data: "):]) for l in lines[:-1]]
  assert all("usage" not in e for e in events) and events[-1]["choices"][0]["finish_reason"]

  # A stop string ends the request with finish_reason "stop"; the text before it is returned.
  text = comp.choices[0].text
  stop = text[4:7]
  assert len(text) >= 7 and stop.strip(), text
  stopped = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10,
                                      temperature=0, stop=[stop],
                                      extra_body={"ignore_eos": True})
  assert stopped.choices[0].finish_reason == "stop"
  assert stopped.choices[0].text == text[:text.index(stop)]


@pytest.mark.parametrize("kind", ["dense", "magicpig"])
def test_concurrent_and_late_streams_equal_alone(servers, kind):
  """4 greedy streams at once, and 2 admitted while 2 others stream, each get exactly the text
  they get alone."""
  client = servers[kind].client()
  alone = [stream_text(client, p) for p in PROMPTS]
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    together = list(pool.map(lambda p: stream_text(client, p), PROMPTS))
  assert together == alone

  def first_two_then_rest():
    streams = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
               for p in PROMPTS[:2]]
    heads = [[next(s).choices[0].text for _ in range(3)] for s in streams]  # both are running
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      late = list(pool.map(lambda p: stream_text(client, p), PROMPTS[2:]))
    early = ["".join(h) + "".join(c.choices[0].text for c in s if c.choices)
             for h, s in zip(heads, streams)]
    return early + late

  assert first_two_then_rest() == alone
  if kind == "magicpig":
    comp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert comp.choices[0].text == alone[0]
    assert 0.0 < comp.model_extra["pigjax"]["pool_fraction"] <= 1.0


@pytest.mark.parametrize("kind", ["dense", "magicpig"])
def test_cancelled_streams_free_their_rows(servers, kind):
  server = servers[kind]
  client = server.client()
  before = server.health()["finished"].get("cancelled", 0)
  streams = [client.completions.create(model=MODEL, prompt=f"stream {i}", max_tokens=480,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}) for i in range(SLOTS)]
  for s in streams:
    next(s)
  assert server.health()["running"] == SLOTS
  for s in streams:
    s.close()
  # Every row was busy for 480 tokens: this one is admitted because the closed streams' rows
  # were freed.
  comp = client.completions.create(model=MODEL, prompt="next", max_tokens=4, temperature=0,
                                   extra_body={"ignore_eos": True})
  assert comp.usage.completion_tokens == 4
  for _ in range(200):
    h = server.health()
    if h["finished"].get("cancelled", 0) - before == SLOTS:
      break
    time.sleep(0.1)
  assert h["finished"].get("cancelled", 0) - before == SLOTS and h["running"] == 0


def test_bad_requests_get_json_errors_and_the_server_keeps_serving(servers):
  server = servers["dense"]
  url = server.url + "/v1"
  chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
  cases = [
      ("/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
      ("/chat/completions", chat | {"temperature": -1}, 400, "temperature"),
      ("/chat/completions", chat | {"model": "gpt-4"}, 404, "model"),
      ("/chat/completions", chat | {"messages": []}, 400, "messages"),
      ("/completions", {"model": MODEL, "prompt": "x" * 600}, 400, "prompt"),
      ("/chat/completions", chat | {"top_p": 0}, 400, "top_p"),
      ("/completions", {"prompt": "x"}, 400, "model"),
  ]
  for path, body, status, param in cases:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == status, (body, r.text)
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
  r = httpx.post(url + "/chat/completions", content=b'{"model": "tiny", "messages": [',
                 headers={"content-type": "application/json"})
  assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
  client = server.client()
  with pytest.raises(openai.NotFoundError):
    client.chat.completions.create(model="nope", messages=chat["messages"])
  with pytest.raises(openai.BadRequestError, match="context"):
    client.completions.create(model=MODEL, prompt="y" * 400, max_tokens=200)
  ok = client.chat.completions.create(model=MODEL, messages=chat["messages"], max_tokens=3,
                                      temperature=0)
  assert ok.choices[0].finish_reason in ("stop", "length")
  assert server.health()["status"] == "ok"
