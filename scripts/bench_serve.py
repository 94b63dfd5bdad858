r"""Serving throughput: requests/s and tokens/s with 1, 4 and 8 concurrent streaming clients.

Starts `python -m pigjax.serve` once per attention kind (or measures a server already running
at --url), then for each concurrency c runs c client threads, each sending --requests streaming
completions one after another (greedy, ignore_eos, so every request generates --max_tokens).

  python scripts/bench_serve.py --out benchmarks/serve.json
  python scripts/bench_serve.py --kinds=dense --clients=1,4 --max_tokens=32 --prompt_chars=2000
  python scripts/bench_serve.py --url=http://127.0.0.1:8000 --kinds=dense   # a running server

Reported per (kind, clients): requests/s, generated tokens/s (all clients together), median
time to first token and median per-request decode tokens/s. Compilation happens at server
start-up and in one untimed warm-up request per concurrency level.
"""

import concurrent.futures
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from absl import app, flags

_CONFIG = flags.DEFINE_string("config", "configs/smollm2_135m.py", "Server config file.")
_KINDS = flags.DEFINE_list("kinds", ["dense", "magicpig"], "Attention kinds to compare.")
_CLIENTS = flags.DEFINE_list("clients", ["1", "4", "8"], "Concurrent streaming clients.")
_REQUESTS = flags.DEFINE_integer("requests", 2, "Requests per client, sent one after another.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Tokens generated per request.")
_PROMPT_CHARS = flags.DEFINE_integer("prompt_chars", 4000,
                                     "Prompt: the first N characters of --prompt_file "
                                     "(each client starts at a different offset).")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", "/usr/share/common-licenses/GPL-3",
                                   "Text the prompts are cut from.")
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", 2048, "Server cache positions per slot.")
_SLOTS = flags.DEFINE_integer("slots", 8, "Server slots (>= the largest --clients).")
_URL = flags.DEFINE_string("url", None, "Measure this running server instead of starting one.")
_OVERRIDES = flags.DEFINE_multi_string("override", [], "Extra --config.x=y server overrides.")
_OUT = flags.DEFINE_string("out", None, "Write the results here as JSON.")

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_server(kind: str) -> tuple[subprocess.Popen, str]:
  port = _free_port()
  cmd = [sys.executable, "-m", "pigjax.serve", f"--config={_CONFIG.value}",
         f"--config.attention.kind={kind}", f"--config.serve.slots={_SLOTS.value}",
         f"--config.max_seq_len={_MAX_SEQ_LEN.value}", f"--port={port}",
         *[f"--config.{o}" for o in _OVERRIDES.value]]
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
  url = f"http://127.0.0.1:{port}"
  for _ in range(1800):
    if proc.poll() is not None:
      raise RuntimeError(f"The {kind} server exited: {proc.stderr.read()[-2000:]}")
    try:
      if httpx.get(url + "/health", timeout=2).status_code == 200:
        return proc, url
    except httpx.HTTPError:
      time.sleep(0.5)
  proc.kill()
  raise RuntimeError(f"The {kind} server did not start.")


def one_request(url: str, model: str, prompt: str) -> dict:
  t0 = time.perf_counter()
  first = None
  body = {"model": model, "prompt": prompt, "max_tokens": _MAX_TOKENS.value, "temperature": 0,
          "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
  tokens = 0
  with httpx.stream("POST", url + "/v1/completions", json=body, timeout=None) as r:
    r.raise_for_status()
    for line in r.iter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      event = json.loads(line[6:])
      if first is None and event.get("choices"):
        first = time.perf_counter()
      if event.get("usage"):
        tokens = event["usage"]["completion_tokens"]
  end = time.perf_counter()
  return {"ttft_s": first - t0, "tokens": tokens, "decode_tps": (tokens - 1) / (end - first)
          if tokens > 1 and end > first else float("nan")}


def measure(url: str, model: str, clients: int, text: str) -> dict:
  step = max(1, (len(text) - _PROMPT_CHARS.value) // max(1, clients))
  prompts = [text[i * step:i * step + _PROMPT_CHARS.value] for i in range(clients)]
  one_request(url, model, prompts[0])  # warm-up (compiles this prompt's prefill bucket)

  def client(i):
    return [one_request(url, model, prompts[i]) for _ in range(_REQUESTS.value)]

  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    results = [r for rs in pool.map(client, range(clients)) for r in rs]
  wall = time.perf_counter() - t0
  return {"clients": clients, "requests": len(results), "wall_s": wall,
          "requests_per_s": len(results) / wall,
          "tokens_per_s": sum(r["tokens"] for r in results) / wall,
          "median_ttft_s": statistics.median(r["ttft_s"] for r in results),
          "median_request_decode_tps": statistics.median(r["decode_tps"] for r in results)}


def main(argv):
  del argv
  logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
  text = Path(_PROMPT_FILE.value).read_text()
  runs = []
  for kind in _KINDS.value:
    proc = None
    url = _URL.value
    if url is None:
      proc, url = start_server(kind)
    try:
      model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
      for c in map(int, _CLIENTS.value):
        r = {"kind": kind, **measure(url, model, c, text)}
        runs.append(r)
        print(f"{kind:9s} clients {c:2d}: {r['requests_per_s']:.2f} req/s, "
              f"{r['tokens_per_s']:.1f} tokens/s, median TTFT {r['median_ttft_s']:.2f} s, "
              f"median per-request decode {r['median_request_decode_tps']:.1f} tokens/s",
              flush=True)
    finally:
      if proc is not None:
        proc.terminate()
        proc.wait()
  if _OUT.value:
    meta = {"command": " ".join(sys.argv), "max_tokens": _MAX_TOKENS.value,
            "prompt_chars": _PROMPT_CHARS.value, "requests_per_client": _REQUESTS.value,
            "slots": _SLOTS.value, "max_seq_len": _MAX_SEQ_LEN.value, "cpus": os.cpu_count()}
    Path(_OUT.value).write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))


if __name__ == "__main__":
  app.run(main)
