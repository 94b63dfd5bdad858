"""docs/configuration.md against pigjax/config.py, and the environment table against the code."""

import dataclasses
import difflib
import re
from pathlib import Path

import pytest

from pigjax import config, pipeline
from tools import config_docs

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "configuration.md"
# Reads (and, in tests and scripts, sets) of an environment variable named PIGJAX_*.
ENV_READ = re.compile(r"""(?:getenv\(|environ\.get\(|environ\[|setenv\(|delenv\(|export\s+)"""
                      r"""\s*["']?(PIGJAX_[A-Z0-9_]+)""")


def test_configuration_md_is_current():
  want = config_docs.markdown_reference()
  have = DOC.read_text() if DOC.exists() else ""
  if have != want:
    diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                             "docs/configuration.md", "generated"))[:60])
    pytest.fail("docs/configuration.md is stale: run `python scripts/gen_config_docs.py` and "
                f"commit the result.\n{diff}")


@pytest.mark.parametrize("prefix,cls", config_docs.sections(),
                         ids=[c.__name__ for _, c in config_docs.sections()])
def test_every_field_has_a_description(prefix, cls):
  assert (cls.__doc__ or "").strip(), f"{cls.__name__} needs a class docstring."
  docs = config_docs.field_docs(cls)
  missing = [prefix + f.name for f in config_docs.leaf_fields(cls) if not docs[f.name].strip()]
  assert not missing, (f"Config fields without a docstring (the string literal under the field "
                       f"in pigjax/config.py): {missing}.")


def _replace(cfg, dotted, value):
  head, _, rest = dotted.partition(".")
  if not rest:
    return dataclasses.replace(cfg, **{head: value})
  return dataclasses.replace(cfg, **{head: _replace(getattr(cfg, head), rest, value)})


@pytest.mark.parametrize("dotted", sorted(config_docs.choices()))
def test_allowed_values_are_what_validation_accepts(dotted):
  pipeline.validate(config.Config())
  config.check_override_path(dotted)
  for value in config_docs.choices()[dotted]:
    pipeline.validate(_replace(config.Config(), dotted, value))
  bogus = 3 if isinstance(config_docs.choices()[dotted][0], int) else "bogus"
  with pytest.raises(ValueError):
    pipeline.validate(_replace(config.Config(), dotted, bogus))


def test_ranges_name_fields():
  for dotted in config_docs.RANGES:
    config.check_override_path(dotted)


def test_environment_table_lists_every_variable_the_code_reads():
  read = {}
  for folder, pattern in (("pigjax", "*.py"), ("xla_ffi", "*"), ("tests", "*.py"),
                          ("scripts", "*")):
    for path in sorted((REPO / folder).rglob(pattern)):
      if path.suffix in (".py", ".h", ".cc", ".sh") and path.name != Path(__file__).name:
        for name in ENV_READ.findall(path.read_text(errors="replace")):
          read.setdefault(name, path.relative_to(REPO).as_posix())
  listed = {v.name for v in config_docs.ENVIRONMENT}
  assert {"PIGJAX_DEBUG", "PIGJAX_KERNELS", "PIGJAX_MATMUL_THREADS"} <= set(read)  # the scan works
  missing = sorted(set(read) - listed)
  assert not missing, (f"{[f'{n} ({read[n]})' for n in missing]} read from the environment but "
                       f"missing from tools.config_docs.ENVIRONMENT; add them and run "
                       f"`python scripts/gen_config_docs.py`.")
  stale = sorted(n for n in listed - set(read) if n.startswith("PIGJAX_"))
  assert not stale, f"ENVIRONMENT lists {stale}, which no source reads any more."

