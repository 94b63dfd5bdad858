"""The library's structure rules (docs/design.md, "Layout"): no module reaches into another's
private names, no library file grows past about 600 lines, and benchmark tooling lives in tools/,
not in the installed package."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pigjax"
MAX_LINES = 600
# The extension module's names are its bindings (public to the package by construction).
EXTENSION = "_pigjax_ffi"
# Package-private modules (pigjax/_ffi.py registers the FFI targets on import) are the package's
# own: importing one is not reaching into another module's private name.
PRIVATE_MODULES = {EXTENSION} | {p.stem for p in PACKAGE.glob("_*.py") if p.stem != "__init__"}


def _modules() -> list[pathlib.Path]:
  return sorted(PACKAGE.rglob("*.py"))


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private_uses(source: str, module: str) -> list[str]:
  """Every use in `source` (the text of pigjax module `module`) of another module's private
  name: `from m import _x`, and `alias._x` where alias is bound by an import of a pigjax module
  other than `module` itself."""
  tree = ast.parse(source)
  found, aliases = [], {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if not node.module.startswith("pigjax"):
        continue
      for a in node.names:
        target = f"{node.module}.{a.name}"
        if (a.name.startswith("_") and node.module != module
            and not (node.module == "pigjax" and a.name in PRIVATE_MODULES)):
          found.append(f"line {node.lineno}: from {node.module} import {a.name}")
        aliases[a.asname or a.name] = target
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith("pigjax"):
          aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "pigjax"
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases and node.attr.startswith("_")
        and not node.attr.startswith("__") and aliases[node.value.id] != module
        and node.value.id not in PRIVATE_MODULES):
      found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
  return found


def test_the_private_name_check_finds_what_it_must():
  src = ("from pigjax.engine import _bucket\nfrom pigjax import magicpig\n"
         "x = magicpig._shift_generated\nfrom pigjax import _pigjax_ffi\n"
         "y = _pigjax_ffi.registrations\nimport numpy as np\nz = np._private\n")
  assert private_uses(src, "pigjax.other") == ["line 1: from pigjax.engine import _bucket",
                                               "line 3: magicpig._shift_generated"]
  # A module's own private names are its business.
  assert private_uses("from pigjax.engine import _x\n", "pigjax.engine") == []


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_uses_another_modules_private_names(path):
  assert private_uses(path.read_text(), _module_name(path)) == []


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_library_files_stay_readable(path):
  lines = path.read_text().count("\n")
  assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (split it)"


def test_the_package_holds_no_benchmark_code():
  """Benchmarks, soak runs and context builders are tools/ (imported by scripts/), not the
  installed library."""
  names = {p.stem for p in _modules()}
  assert not names & {"bench", "bench_contexts", "soak", "config_docs"}
  for path in _modules():
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
        assert not any(m and (m == "tools" or m.startswith("tools.")) for m in mods), path
