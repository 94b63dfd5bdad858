"""Several processes, one program: jax's multi-controller runtime (docs/scaling.md).

Every process runs the same code on its own share of the batch (`split`). Under a mesh whose
"data" axis spans the processes (`pigjax.sharding`), each process feeds its own rows into the
global arrays and reads its own rows back; the few host-side decisions that must agree between
processes (padded shapes, when the decode loop stops) are taken here with small all-gathers.
With one process every function is the identity, and nothing is communicated.

    multihost.initialize("localhost:1234", num_processes=2, process_id=0)  # before jax starts
    mine = multihost.split(prompts)
    results, stats = pipe.generate(mine)
    texts = multihost.gather_strings([r.text for r in results])  # every row, in order
    multihost.shutdown()
"""

from __future__ import annotations

import os
from typing import Sequence, TypeVar

import numpy as np

T = TypeVar("T")

# The environment variables `initialize` reads when an argument is not given.
ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = (
    "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, cpu_devices: int = 0) -> bool:
  """Joins the processes with `jax.distributed.initialize`; must run before jax's backends start
  (before `pigjax.pipeline` or any jax computation is imported / run).

  Args:
    coordinator_address: "host:port" of process 0's coordinator; default $JAX_COORDINATOR_ADDRESS.
    num_processes, process_id: default $JAX_NUM_PROCESSES and $JAX_PROCESS_ID.
    cpu_devices: CPU devices per process (`jax_num_cpu_devices`); 0 keeps jax's default.
  Returns:
    True if the processes were joined, False for a single-process run (nothing set).
  Raises:
    ValueError: some but not all of the three settings are given, or they are malformed.
  """
  import jax
  if cpu_devices:
    jax.config.update("jax_num_cpu_devices", int(cpu_devices))
  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
  num_processes = _int_setting("num_processes", num_processes, ENV_NUM_PROCESSES)
  process_id = _int_setting("process_id", process_id, ENV_PROCESS_ID)
  given = [coordinator_address is not None, num_processes is not None, process_id is not None]
  if not any(given):
    return False
  if not all(given):
    raise ValueError(
        "A multi-process run needs all of the coordinator address, the number of processes and "
        f"this process's id (flags --coordinator_address, --num_processes, --process_id, or "
        f"${ENV_COORDINATOR}, ${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID}); got "
        f"address={coordinator_address!r}, num_processes={num_processes}, "
        f"process_id={process_id}.")
  if num_processes < 1 or not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, num_processes); got process_id={process_id}, "
                     f"num_processes={num_processes}.")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id)
  return True


def _int_setting(name: str, value: int | None, env: str) -> int | None:
  if value is not None:
    return int(value)
  text = os.environ.get(env, "")
  if not text:
    return None
  try:
    return int(text)
  except ValueError:
    raise ValueError(f"${env}={text!r} is not an integer ({name}).") from None


def shutdown() -> None:
  """Leaves the multi-process run (a no-op for a single process)."""
  import jax
  if jax.process_count() > 1:
    jax.distributed.shutdown()


def split(items: Sequence[T]) -> list[T]:
  """This process's contiguous share of `items` (process i gets the i-th equal part).

  Raises ValueError unless the processes divide the items evenly: every process must run the
  same shapes.
  """
  import jax
  n, i = jax.process_count(), jax.process_index()
  if len(items) % n:
    raise ValueError(f"{len(items)} prompts do not split evenly over {n} processes; give a "
                     f"multiple of {n}.")
  share = len(items) // n
  return list(items[i * share:(i + 1) * share])


def _allgather(x: np.ndarray) -> np.ndarray:
  """[processes, *x.shape]: every process's x (the same shape everywhere)."""
  import jax
  if jax.process_count() == 1:
    return np.asarray(x)[None]
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=False))


def global_max(n: int) -> int:
  return int(_allgather(np.array(n, np.int64)).max())


def same_everywhere(n: int, what: str) -> int:
  """n, after checking that every process has the same value (a ValueError naming `what`)."""
  values = _allgather(np.array(n, np.int64))
  if (values != n).any():
    raise ValueError(f"Every process must have the same {what}; got {values.tolist()}.")
  return n


def all_true(flag: bool) -> bool:
  """Whether `flag` holds in every process (so they all stop a loop at the same step)."""
  return bool(_allgather(np.array(bool(flag))).all())


def gather_strings(texts: Sequence[str]) -> list[str]:
  """Every process's `texts`, concatenated in process order (each process gives as many)."""
  count = same_everywhere(len(texts), "number of rows to gather")
  raw = [t.encode("utf-8") for t in texts]
  width = global_max(max((len(r) for r in raw), default=0))
  lengths = _allgather(np.array([len(r) for r in raw], np.int64))
  buf = np.zeros((count, width), np.uint8)
  for i, r in enumerate(raw):
    buf[i, :len(r)] = np.frombuffer(r, np.uint8)
  every = _allgather(buf)
  return [every[p, i, :lengths[p, i]].tobytes().decode("utf-8")
          for p in range(every.shape[0]) for i in range(count)]
