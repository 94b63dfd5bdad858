r"""Serve a model over an OpenAI-compatible HTTP API with continuous batching.

  python -m pigjax.serve --config configs/smollm2_135m.py --port 8000
  python -m pigjax.serve --config configs/smollm2_135m.py --config.attention.kind=magicpig \
      --config.serve.slots=8 --config.max_seq_len=8192

Then, for example, `openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")`.
Needs the `serve` extra (`pip install -e ".[serve]"`: fastapi, uvicorn). A bad flag, setting or
path ends the start with one `pigjax: error: ...` line; `--debug` (or PIGJAX_DEBUG=1) shows the
traceback instead. The port is bound before the model loads, so a busy port is reported at once.
"""

import os
import socket
import sys

from absl import app, flags
from ml_collections import config_flags

from pigjax import cli
from pigjax import config as config_lib
from pigjax import pipeline, placement

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2_135m.py",
                                          "A configs/*.py file with get_config().")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0 for all).")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.")
_LOG_LEVEL = flags.DEFINE_enum("log_level", "warning", ["debug", "info", "warning", "error"],
                               "uvicorn's log level (info shows one line per request).")
_CACHE = flags.DEFINE_string("compilation_cache", os.path.expanduser("~/.cache/pigjax/jax"),
                             "Persistent XLA compilation cache ('' disables it).")
flags.DEFINE_bool("debug", False, "Show the traceback of every error (for bug reports).")


def serve(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  cfg = config_lib.from_config_dict(_CONFIG.value)
  pipeline.validate(cfg)  # before the (slow) weight load
  placement.quiet_jax_logs()
  try:
    import uvicorn
    from pigjax.serving.service import build_service
  except ImportError as e:
    raise ValueError(f"pigjax.serve needs the serve extra: pip install -e '.[serve]' ({e}).")
  sock = bind(_HOST.value, _PORT.value)
  import jax
  if _CACHE.value:
    jax.config.update("jax_compilation_cache_dir", _CACHE.value)
  service = build_service(cfg, progress=True)
  s = service.cfg.serve
  print(f"pigjax: serving '{service.model_name}' ({service.cfg.attention.kind} attention, "
        f"{s.slots} slots x {service.scheduler.context_limit} tokens) on "
        f"http://{_HOST.value}:{sock.getsockname()[1]}/v1", file=sys.stderr, flush=True)
  try:
    config = uvicorn.Config(service.app, log_level=_LOG_LEVEL.value,
                            access_log=_LOG_LEVEL.value in ("debug", "info"))
    uvicorn.Server(config).run(sockets=[sock])
  finally:
    service.scheduler.stop()


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
