"""One client cannot hurt the others: every field is validated before admission (400 in
OpenAI's JSON error format, naming the field), bodies are size-limited (413), a client that gives
up on a non-streaming request frees its row at once, and a second server on a busy port stops
before loading the model. The real `python -m pigjax.serve` on 127.0.0.1, a tiny checkpoint."""

import concurrent.futures
import socket
import subprocess
import sys
import time

import httpx
import pytest

import tiny_checkpoint
from test_server import MODEL, REPO, Server, _user_env, stream_text

BODY_LIMIT = 1 << 18  # above the 100,000-bracket body, far below the default
CONTEXT = 4096  # room for a request that outlasts its client by seconds


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  d = tmp_path_factory.mktemp("tiny")
  tiny_checkpoint.write_tiny_llama(d, max_position=CONTEXT)
  return d


@pytest.fixture(scope="module")
def server(ckpt):
  s = Server(ckpt, "dense", ckpt / "dense.log",
             extra_args=[f"--config.serve.max_body_bytes={BODY_LIMIT}",
                         f"--config.max_seq_len={CONTEXT}"])
  try:
    yield s.wait_ready()
  finally:
    s.stop()


def _post(server, path, content: bytes | None = None, **kw):
  return httpx.post(server.url + "/v1" + path, content=content,
                    headers={"content-type": "application/json"}, timeout=60, **kw)


def _error(r, status: int) -> dict:
  assert r.status_code == status, r.text
  assert r.headers["content-type"].startswith("application/json"), r.headers
  return r.json()["error"]


def test_an_out_of_range_top_k_is_refused_while_a_stream_goes_on(server):
  """Past int32 it once overflowed at admission and failed every stream in flight."""
  client = server.client()
  alone = stream_text(client, "Once upon a time", max_tokens=40)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    streaming = pool.submit(stream_text, client, "Once upon a time", max_tokens=40)
    time.sleep(0.3)
    for top_k in (2**31, 2**63, -1):
      r = httpx.post(server.url + "/v1/completions", timeout=60, json={
          "model": MODEL, "prompt": "Hi", "max_tokens": 4, "top_k": top_k})
      err = _error(r, 400)
      assert err["param"] == "top_k" and "top_k" in err["message"], err
    assert streaming.result(timeout=120) == alone
  assert server.health()["finished"].get("error", 0) == 0


CHAT = '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": %s}]}'
COMP = '{"model": "tiny", "max_tokens": 2, "prompt": "Hi", %s}'


@pytest.mark.parametrize("path, body, param", [
    ("/completions", '{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
    ("/chat/completions", CHAT % '"x\\udfffy"', "messages[0].content"),
    ("/chat/completions", CHAT % '[{"type": "text", "text": "\\ud800"}]',
     "messages[0].content[0].text"),
    ("/completions", COMP % ('"seed": ' + "7" * 5000), "seed"),
    ("/completions", COMP % '"seed": 9223372036854775808', "seed"),
    ("/completions", COMP % '"ignore_eos": "false"', "ignore_eos"),
    ("/completions", COMP % '"stream": "true"', "stream"),
    ("/completions", COMP % '"stream": true, "stream_options": {"include_usage": 1}',
     "stream_options.include_usage"),
    ("/chat/completions", CHAT % '[{"type": "text", "text": 5}]',
     "messages[0].content[0].text"),
    ("/completions", COMP % '"max_tokens": 1e300', "max_tokens"),
    ("/completions", COMP % '"temperature": 1e400', "temperature"),
    ("/completions", COMP % '"repetition_penalty": 1e39', "repetition_penalty"),
    ("/completions", COMP % '"min_p": 1', "min_p"),
    ("/completions", COMP % '"top_p": "0.5"', "top_p"),
])
def test_malformed_fields_get_400_naming_them(server, path, body, param):
  err = _error(_post(server, path, body.encode()), 400)
  assert err["param"] == param and err["type"] == "invalid_request_error", err
  assert param.split(".")[-1].split("[")[0] in err["message"], err


def test_unparseable_bodies_get_400_json(server):
  for raw, words in [(b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
                     (b'{"model": "tiny", "prompt": "\xff"}', "not valid JSON"),
                     (b'["a list"]', "JSON object")]:
    assert words in _error(_post(server, "/completions", raw), 400)["message"]
  assert server.health()["status"] == "ok"


def test_bodies_past_the_limit_get_413_before_parsing(server):
  big = b'{"model": "tiny", "prompt": "' + b"x" * BODY_LIMIT + b'"}'
  err = _error(_post(server, "/completions", big), 413)
  assert "max_body_bytes" in err["message"], err

  def chunked():  # no Content-Length: the limit holds while reading
    for i in range(0, len(big), 4096):
      yield big[i:i + 4096]

  _error(_post(server, "/completions", chunked()), 413)
  ok = _post(server, "/completions", b'{"model": "tiny", "prompt": "Hi", "max_tokens": 2}')
  assert ok.status_code == 200, ok.text


def test_a_non_streaming_client_that_gives_up_frees_its_row_at_once(server):
  """A long non-streaming request keeps producing tokens (4,000 take several seconds); when its
  client goes away, the row is free within a fraction of a second, not when max_tokens is
  reached."""
  before = server.health()["finished"].get("cancelled", 0)
  body = {"model": MODEL, "prompt": "Hi", "max_tokens": CONTEXT - 96, "temperature": 0,
          "ignore_eos": True}
  with pytest.raises(httpx.ReadTimeout):
    httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.6))
  gave_up = time.monotonic()
  while time.monotonic() - gave_up < 5:
    h = server.health()
    if h["running"] == 0 and h["waiting"] == 0:
      break
    time.sleep(0.05)
  freed_after = time.monotonic() - gave_up
  assert h["finished"].get("cancelled", 0) == before + 1, h  # cancelled, not run to the end
  assert freed_after < 1.5, freed_after


def test_a_second_server_on_a_busy_port_stops_before_loading(ckpt):
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "pigjax.serve", "--config=configs/tiny.py",
         f"--config.checkpoint={ckpt}", "--compilation_cache=", f"--port={port}"],
        cwd=REPO, capture_output=True, text=True, env=_user_env(), timeout=120)
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2 and len(lines) == 1, out.stderr
  assert lines[0].startswith("pigjax: error: ") and str(port) in lines[0], out.stderr
  assert "in use" in lines[0] and "serving" not in out.stderr, out.stderr
  assert time.monotonic() - start < 60
