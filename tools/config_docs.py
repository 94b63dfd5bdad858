"""The reference of every config field and environment variable, as docs/configuration.md.

A field's meaning is its attribute docstring in `pigjax/config.py` (the string literal under
it), its allowed values are the validation's own lists, and the environment variables are the
`ENVIRONMENT` table below; `markdown_reference()` renders them and
`scripts/gen_config_docs.py` writes the file. tests/test_config_docs.py fails when the file is
stale, when a field has no docstring, or when the code reads a PIGJAX_* variable that
`ENVIRONMENT` lacks.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
from typing import Any

from pigjax import config, multihost


@dataclasses.dataclass(frozen=True)
class EnvVar:
  name: str
  values: str  # what it accepts
  default: str  # what happens when it is unset
  read_by: str  # the source files that read it
  doc: str


# Every environment variable pigjax reads (tests/test_config_docs.py checks the sources for
# PIGJAX_* reads missing here).
ENVIRONMENT = (
    EnvVar("PIGJAX_DEBUG", "anything but empty or `0`", "off", "pigjax/cli.py",
           "The entry points (`pigjax.generate`, `pigjax.serve`, the scripts) show a user "
           "error's traceback instead of one `pigjax: error: ...` line and exit status 2; the "
           "same as `--debug`."),
    EnvVar("PIGJAX_KERNELS", "`scalar`", "AVX2 + FMA (+ F16C) kernels when the CPU has them",
           "xla_ffi/kernels.h, xla_ffi/quant.h",
           "`scalar` forces the portable C++ kernels: the host store's lookup, gather and "
           "attention, the proxy scan, the dense decode attention and the quantized matmul (for "
           "tests, and to compare the two). Read when a host store is created and at every dense "
           "decode attention or quantized matmul call."),
    EnvVar("PIGJAX_SPIN_US", "integer microseconds >= 0", "200", "xla_ffi/thread_pool.h",
           "How long a worker of pigjax's C++ thread pools (the compute pool, each store's own) "
           "polls for the next task before it sleeps. A decode step calls the pools every few "
           "hundred microseconds and waking a sleeping worker costs tens; `0` sleeps at once, a "
           "long spin holds cores that XLA's own threads want."),
    EnvVar("PIGJAX_PREFETCH_AHEAD", "integer >= 1 (smaller values count as 1)", "16",
           "xla_ffi/kernels.h",
           "How many candidates ahead the host store's gather prefetches their K/V rows: each "
           "row is at a random place of the pool, a cache miss unless requested early."),
    EnvVar("PIGJAX_HUGE_PAGES", "`0`", "on", "xla_ffi/kernels.h",
           "`0` leaves out the transparent-huge-page advice (`madvise`) on the host store's "
           "blocks of 2 MiB and more (pool rows, table ids); with 4 KiB pages nearly every random "
           "row read is a TLB miss as well as a cache miss."),
    EnvVar("PIGJAX_MATMUL_THREADS", f"integer 1 to {config.MAX_THREADS} (larger values count "
           f"as {config.MAX_THREADS})", "all hardware threads", "xla_ffi/quant_ffi.cc",
           "Threads of the process's compute pool, which runs the quantized matmuls, the dense "
           "decode attention kernel and a host store with `attention.threads=0`. Unset, `0` or "
           "not a number: all hardware threads. Read when the pool first starts."),
    EnvVar("PIGJAX_API_KEY", "keys separated by commas", "unset: no key", "pigjax/serve.py",
           "Keys the server accepts in `Authorization: Bearer <key>`, added to `--api_key` and "
           "`serve.api_keys`; keeps them out of the process list."),
    EnvVar(multihost.ENV_COORDINATOR, "`host:port`", "unset: one process", "pigjax/multihost.py",
           "Process 0's coordinator of a multi-process run (`jax.distributed`), when "
           "`--coordinator_address` is not given. Set all three multi-process variables (or "
           "flags) or none."),
    EnvVar(multihost.ENV_NUM_PROCESSES, "integer >= 1", "unset: one process",
           "pigjax/multihost.py", "Processes in the run, when `--num_processes` is not given."),
    EnvVar(multihost.ENV_PROCESS_ID, "integer in [0, processes)", "unset: one process",
           "pigjax/multihost.py", "This process's index, when `--process_id` is not given."),
    EnvVar("PIGJAX_FUZZ_EXAMPLES", "integer >= 0", "0: the fixed 60 examples",
           "tests/test_fuzz.py",
           "Tests only: N > 0 runs the FFI fuzz tests as a randomised search of N examples."),
    EnvVar("PIGJAX_SANITIZED", "non-empty", "unset", "tests/test_robustness.py",
           "Tests only: set by scripts/sanitize.sh; skips the test that limits the address space "
           "(ASan reserves terabytes of it)."),
)


def field_docs(cls: type) -> dict[str, str]:
  """{field name: its attribute docstring, cleaned} for the dataclass `cls` ("" when none)."""
  (tree,) = ast.parse(inspect.getsource(cls)).body
  docs = {f.name: "" for f in dataclasses.fields(cls)}
  for stmt, after in zip(tree.body, tree.body[1:]):
    if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
        and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)):
      docs[stmt.target.id] = inspect.cleandoc(after.value.value)
  return docs


def choices() -> dict[str, tuple]:
  """{dotted field name: its allowed values} for the fields with a fixed set, from the lists the
  validation (`pipeline.validate`, `config.validate_attention`) checks against."""
  from pigjax import model, pipeline  # heavy (jax); only the generator and its test need them
  return {
      "dtype": tuple(pipeline._DTYPES),
      "cache_dtype": ("auto", *pipeline._DTYPES),
      "weights": model.WEIGHT_FORMATS,
      "act_bits": (8, 16),  # pipeline.validate and quant.QTensor check these two
      "attention.kind": config.ATTENTION_KINDS,
      "attention.estimator": config.ESTIMATORS,
      "attention.proxy_tail": config.PROXY_TAILS,
      "attention.decode_kernel": config.DECODE_KERNELS,
      "attention.store_dtype": config.STORE_DTYPES,
  }


# Bounds that come from named constants (other bounds are in the fields' docstrings).
RANGES = {
    "attention.num_bits": f"1 to {config.MAX_NUM_BITS}",
    "attention.threads": f"0 to {config.MAX_THREADS}",
}


def sections(cls: type = config.Config, prefix: str = "") -> list[tuple[str, type]]:
  """[(dotted prefix, dataclass)] of `cls` and every section under it, depth first."""
  out = [(prefix, cls)]
  for f in dataclasses.fields(cls):
    default = getattr(cls(), f.name)
    if dataclasses.is_dataclass(default):
      out += sections(type(default), f"{prefix}{f.name}.")
  return out


def leaf_fields(cls: type) -> list[dataclasses.Field]:
  """The fields of `cls` that hold values (not sections)."""
  return [f for f in dataclasses.fields(cls)
          if not dataclasses.is_dataclass(getattr(cls(), f.name))]


def _literal(value: Any) -> str:
  if isinstance(value, str):
    return json.dumps(value)
  if isinstance(value, tuple):
    items = ", ".join(_literal(v) for v in value)
    return f"({items},)" if len(value) == 1 else f"({items})"
  return repr(value)


def _cell(text: str) -> str:
  return " ".join(text.split()).replace("|", "\\|")


def _paragraph(text: str) -> list[str]:
  return textwrap.wrap(" ".join(text.split()), 100, break_long_words=False,
                       break_on_hyphens=False)


def _bullet(text: str) -> list[str]:
  return textwrap.wrap(" ".join(text.split()), 100, initial_indent="- ", subsequent_indent="  ",
                       break_long_words=False, break_on_hyphens=False)


def _example_unknown_key() -> str:
  try:
    config.check_override_path("mesh.dat")
  except ValueError as e:
    return f"pigjax: error: {e}"
  raise AssertionError("check_override_path accepted an unknown key")


def markdown_reference() -> str:
  """docs/configuration.md's text."""
  allowed = {k: ", ".join(f"`{_literal(v)}`" for v in vs) for k, vs in choices().items()}
  allowed |= RANGES
  lines = [
      "# Configuration",
      "",
      "<!-- Generated from pigjax/config.py and tools/config_docs.py by",
      "     `python scripts/gen_config_docs.py`; edit those, not this file. -->",
      "",
      "Every setting is a field of the frozen dataclasses in `pigjax/config.py`:",
      "",
      *_bullet("On the command line `--config configs/<preset>.py` picks a preset (its "
               "`get_config()`) and `--config.<field>=<value>` overrides any field below by its "
               "dotted name: `--config.attention.num_bits=9`."),
      *_bullet("Tuples take Python syntax: `--config.attention.dense_layers='(0, 8)'`, "
               "`--config.sampling.stop_strings='(\"\\n\\n\", \"END\")'`."),
      *_bullet("From Python, build `Config(...)` or derive one from a preset: "
               "`dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, "
               "kind=\"magicpig\"))`."),
      *_bullet("An unknown key stops the command before anything loads, naming the known keys:"),
      "",
      "```",
      "$ python -m pigjax.generate --config configs/smollm2_135m.py --config.mesh.dat=2 "
      "--prompt Hi",
      _example_unknown_key(),
      "```",
  ]
  for prefix, cls in sections():
    name = f"`{prefix.rstrip('.')}`" if prefix else "Top level"
    lines += ["", f"## {name} (`{cls.__name__}`)", "",
              *_paragraph(inspect.cleandoc(cls.__doc__ or "")), "",
              "| Field | Type | Default | Allowed | Meaning |", "|---|---|---|---|---|"]
    docs = field_docs(cls)
    for f in leaf_fields(cls):
      dotted = prefix + f.name
      lines.append(f"| `{dotted}` | `{f.type}` | `{_literal(getattr(cls(), f.name))}` | "
                   f"{_cell(allowed.get(dotted, ''))} | {_cell(docs[f.name])} |")
  lines += [
      "", "## Environment variables", "",
      *_paragraph("Read by the library, its C++ kernels and its tests (jax's own, such as "
                  "`JAX_PLATFORMS` and `JAX_NUM_CPU_DEVICES`, apply as usual). The C++ kernels "
                  "read theirs once per process unless the entry says otherwise."), "",
      "| Variable | Values | Default | Read by | Effect |", "|---|---|---|---|---|",
  ]
  for v in ENVIRONMENT:
    lines.append(f"| `{v.name}` | {_cell(v.values)} | {_cell(v.default)} | {_cell(v.read_by)} | "
                 f"{_cell(v.doc)} |")
  return "\n".join(lines) + "\n"
