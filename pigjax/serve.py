r"""Serve a model over an OpenAI-compatible HTTP API with continuous batching.

  python -m pigjax.serve --config configs/smollm2_135m.py --port 8000
  python -m pigjax.serve --config configs/smollm2_135m.py --config.attention.kind=magicpig \
      --config.serve.slots=8 --config.max_seq_len=8192

Then, for example, `openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")`.
Needs the `serve` extra (`pip install -e ".[serve]"`: fastapi, uvicorn, prometheus_client). A bad
flag, setting or path ends the start with one `pigjax: error: ...` line; `--debug` (or
PIGJAX_DEBUG=1) shows the traceback instead. The port is bound before the model loads, so a busy
port is reported at once.

`--api_key` (repeatable or comma-separated; also serve.api_keys and PIGJAX_API_KEY) makes every
request but /health need `Authorization: Bearer <key>`; keep keys out of the process list with
PIGJAX_API_KEY or absl's `--flagfile=FILE` (a file of `--api_key=...` lines). SIGTERM or Ctrl-C drains the server:
new requests get 503 while the running ones finish, for up to serve.shutdown_grace_s seconds,
then it exits with status 0; a second signal exits at once (docs/serving.md, "Operating").
"""

import dataclasses
import logging
import os
import signal
import socket
import sys
import threading

from absl import app, flags

from pigjax import cli
from pigjax import config as config_lib
from pigjax import pipeline, placement

_CONFIG = cli.define_config()
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0 for all).")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.")
_LOG_LEVEL = flags.DEFINE_enum("log_level", "warning", ["debug", "info", "warning", "error"],
                               "Log level of uvicorn and pigjax.serving.")
_ACCESS_LOG = flags.DEFINE_bool("access_log", True, "One line per request on stderr (id, "
                                "client, status, tokens, latency), whatever --log_level says.")
_API_KEY = flags.DEFINE_multi_string("api_key", [], "A key clients must send as 'Authorization: "
                                     "Bearer <key>' (repeat the flag or separate keys with "
                                     "commas for several); added to serve.api_keys.")
_CACHE = flags.DEFINE_string("compilation_cache", os.path.expanduser("~/.cache/pigjax/jax"),
                             "Persistent XLA compilation cache ('' disables it).")
flags.DEFINE_bool("debug", False, "Show the traceback of every error (for bug reports).")


def serve(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  cfg = config_lib.from_config_dict(_CONFIG.value)
  given = [*_API_KEY.value, os.environ.get("PIGJAX_API_KEY", "")]
  keys = tuple(k.strip() for flag in given for k in flag.split(",") if k.strip())
  if keys:
    cfg = dataclasses.replace(cfg, serve=dataclasses.replace(
        cfg.serve, api_keys=tuple(dict.fromkeys(cfg.serve.api_keys + keys))))
  pipeline.validate(cfg)  # before the (slow) weight load
  placement.quiet_jax_logs()
  try:
    import uvicorn
    from pigjax.serving.service import build_service, validate_serve
  except ImportError as e:
    raise ValueError(f"pigjax.serve needs the serve extra: pip install -e '.[serve]' ({e}).")
  validate_serve(cfg.serve)
  _configure_logs(_LOG_LEVEL.value, _ACCESS_LOG.value)
  sock = bind(_HOST.value, _PORT.value)
  import jax
  if _CACHE.value:
    jax.config.update("jax_compilation_cache_dir", _CACHE.value)
  service = build_service(cfg, progress=True)
  s = service.cfg.serve
  print(f"pigjax: serving '{service.model_name}' ({service.cfg.attention.kind} attention, "
        f"{s.slots} slots x {service.scheduler.context_limit} tokens) on "
        f"http://{_HOST.value}:{sock.getsockname()[1]}/v1"
        f"{' (API key required)' if s.api_keys else ''}", file=sys.stderr, flush=True)
  try:
    # The drain has already given the running requests their grace; what is left after it
    # is cut within a second.
    config = uvicorn.Config(service.app, log_level=_LOG_LEVEL.value, access_log=False,
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    server.handle_exit = _Drain(server, service.app.state.ops, s.shutdown_grace_s).handle_exit
    server.run(sockets=[sock])
  finally:
    service.scheduler.stop()


def _configure_logs(level: str, access: bool) -> None:
  """pigjax.serving's records (the scheduler's errors, the access log) on stderr, in uvicorn's
  style; the access log at INFO whatever `level` is, unless `access` is off."""
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s: %(message)s"))
  root = logging.getLogger("pigjax.serving")
  root.handlers[:] = [handler]
  root.setLevel(level.upper())
  root.propagate = False
  logging.getLogger("pigjax.serving.access").setLevel(
      logging.INFO if access else logging.CRITICAL + 1)


class _Drain:
  """The first SIGTERM or SIGINT drains instead of stopping at once: the app answers 503 to new
  requests (`Ops.drain`) while the ones in flight finish, for up to `grace_s` seconds; then
  uvicorn shuts down as usual and the process exits with 0 (uvicorn's own handler records the
  signal and re-raises it after its shutdown, which would end the process with -15). A second
  signal exits at once."""

  def __init__(self, server, ops, grace_s: float):
    self.server, self.ops, self.grace_s = server, ops, grace_s
    self.started = False

  def handle_exit(self, sig, frame) -> None:
    if self.started:
      self.server.should_exit = self.server.force_exit = True
      return
    self.started = True
    self.ops.drain()
    threading.Thread(target=self._exit_when_idle, args=(signal.Signals(sig).name,),
                     name="pigjax-drain", daemon=True).start()

  def _exit_when_idle(self, sig: str) -> None:  # not in the handler: it may interrupt a print
    print(f"pigjax: {sig}: draining ({self.ops.in_flight} requests in flight, up to "
          f"{self.grace_s:g} s)", file=sys.stderr, flush=True)
    if not self.ops.wait_idle(self.grace_s):
      print(f"pigjax: {self.ops.in_flight} requests still running after "
            "serve.shutdown_grace_s; ending them", file=sys.stderr, flush=True)
    self.server.should_exit = True


def bind(host: str, port: int) -> socket.socket:
  """A socket bound to host:port (uvicorn listens on it once the model is loaded)."""
  try:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
  except socket.gaierror as e:
    raise ValueError(f"--host {host} is not an address this machine can listen on ({e}).")
  family, kind, proto, _, addr = infos[0]
  sock = socket.socket(family, kind, proto)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart at once
  try:
    sock.bind(addr)
  except OSError as e:
    sock.close()
    raise ValueError(f"Cannot listen on {host}:{port}: {e.strerror or e} (another server may "
                     "be using the port; pick another with --port).") from None
  return sock


def main(argv):
  cli.run_main(serve, argv)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
