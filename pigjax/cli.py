"""Command-line plumbing shared by `python -m pigjax.generate` and the scripts: flag parsing that
names a bad `--config.*` override, prompt files, and user errors as one line instead of a
traceback (`--debug` or PIGJAX_DEBUG=1 keeps the traceback, for bug reports).
"""

from __future__ import annotations

import os
import sys
from typing import Callable, NoReturn

from absl import app, flags
from ml_collections import config_flags

from pigjax import config as config_lib

# Errors a user can cause and fix (a bad flag, path, setting or prompt). Anything else is a bug
# and keeps its traceback.
USER_ERRORS = (ValueError, OSError, MemoryError, flags.Error, app.UsageError)


def debug_requested(argv: list[str] | None = None) -> bool:
  """--debug on the command line (read from argv, so it works before absl has parsed it) or
  PIGJAX_DEBUG=1."""
  argv = sys.argv if argv is None else argv
  on = any(a in ("--debug", "--debug=true", "--debug=True", "--debug=1") for a in argv)
  return on or os.environ.get("PIGJAX_DEBUG", "") not in ("", "0")


def fail(error: BaseException | str) -> NoReturn:
  """Prints `pigjax: error: <message>` to stderr and exits with status 2."""
  message = str(error).strip()
  if isinstance(error, KeyError) and message.startswith(("'", '"')):
    message = message.strip("'\"")
  print(f"pigjax: error: {message}", file=sys.stderr)
  sys.exit(2)


def _check_config_overrides(argv: list[str]) -> None:
  """Exits with a one-line error naming the known keys if a `--config.a.b=v` in argv names no
  Config field."""
  for arg in argv[1:]:
    if arg.startswith("--config."):
      try:
        config_lib.check_override_path(arg[len("--config."):].split("=", 1)[0])
      except ValueError as e:
        fail(e)


def define_config(default: str = "configs/smollm2_135m.py"):
  """The `--config` flag (a configs/*.py file with get_config()), for the CLIs and scripts.

  ml_collections reads `--config.*` overrides from sys.argv when the flag is defined (at
  import, before any flags_parser runs), so the override paths are checked here: a mistyped
  key is one line naming the known keys, not an AttributeError traceback at import.
  """
  if not debug_requested():
    _check_config_overrides(sys.argv)
  return config_flags.DEFINE_config_file("config", default,
                                         "A configs/*.py file with get_config().")


def parse_flags(argv: list[str]) -> list[str]:
  """An `app.run(flags_parser=...)`: absl's parse, with a bad flag or override value as one line.

  Unknown `--config.*` keys were already named by `define_config`, which must define the flag.
  """
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # absl flag errors and ml_collections override errors (bad values)
    if debug_requested(argv):
      raise
    fail(e)


def run_main(main: Callable[[list[str]], None], argv: list[str]) -> None:
  """Calls main(argv); a user error becomes one line on stderr and exit status 2."""
  try:
    main(argv)
  except USER_ERRORS as e:
    if debug_requested():  # sys.argv: absl has removed the flags from argv
      raise
    fail(e)


def read_prompt_file(path: str) -> str:
  """The file's text; ValueError naming the file if it cannot be read or is not UTF-8."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise ValueError(f"Cannot read --prompt_file {path}: {e.strerror or e}.") from e
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"--prompt_file {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at "
                     f"offset {e.start}); convert it to UTF-8, e.g. with iconv.") from e
