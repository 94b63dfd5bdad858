"""Where pigjax's programs run, and keeping jax's start-up chatter out of the user's way.

MagicPIG's host KV store is driven by XLA FFI handlers registered for the CPU platform only
(docs/design.md, "Placement on a GPU host"). On a machine with a GPU (a Colab runtime) jax places
computations on the GPU by default, and a jitted MagicPIG step would then fail to compile its
custom calls. So whenever MagicPIG attention is used and the default platform is not the CPU,
pigjax makes the CPU the default device (`jax_default_device`); dense attention keeps the GPU.
"""

from __future__ import annotations

import logging
import sys
from typing import Sequence


def decode_runs_on_cpu(attention_kind: str) -> bool:
  """Whether the decode step runs on the CPU: jax's default, or MagicPIG (placed there)."""
  import jax
  return jax.default_backend() == "cpu" or attention_kind == "magicpig"


def host_store_platform(attention_kind: str, default_platform: str,
                        platforms: Sequence[str]) -> str | None:
  """The platform MagicPIG's programs must be moved to, or None to keep jax's default.

  Args:
    attention_kind: "dense" or "magicpig".
    default_platform: `jax.default_backend()`, e.g. "cpu", "gpu", "tpu".
    platforms: the platforms of every available device.
  Raises:
    ValueError: MagicPIG asked for where no CPU device exists (a setting the user can change,
      so the CLI and server report it as one line).
  """
  if attention_kind != "magicpig" or default_platform == "cpu":
    return None
  if "cpu" not in platforms:
    raise ValueError("MagicPIG attention needs a CPU device for its host KV store; start jax "
                       "with the CPU platform enabled (JAX_PLATFORMS unset, or including 'cpu').")
  return "cpu"


def place_for(attention_kind: str) -> None:
  """Makes the CPU jax's default device when `attention_kind` needs it (see the module doc)."""
  import jax
  platforms = {d.platform for d in jax.devices()} | {"cpu"}
  try:
    jax.devices("cpu")
  except RuntimeError:
    platforms.discard("cpu")
  target = host_store_platform(attention_kind, jax.default_backend(), sorted(platforms))
  if target is None or jax.config.jax_default_device is not None:
    return
  jax.config.update("jax_default_device", jax.devices(target)[0])
  print(f"pigjax: MagicPIG's host KV store runs on the CPU, so its programs do too (jax's "
        f"default was {jax.default_backend()}); dense attention uses the accelerator.",
        file=sys.stderr)


def quiet_jax_logs() -> None:
  """Hides jax's backend-probing messages ("Unable to initialize backend 'tpu'" ...), which
  absl's INFO-level logging would otherwise print at every start. Call before jax starts."""
  for name in ("jax._src.xla_bridge", "jax._src.compiler", "jax._src.dispatch"):
    logging.getLogger(name).setLevel(logging.WARNING)
