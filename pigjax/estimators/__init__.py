"""Pool estimators as strategies, registered by name (`attention.estimator`).

An estimator decides how the sparse layers' pool (prompt positions [sink, n - window) and the
generated tokens moved there later) is indexed at insert and how rows are selected and weighed at
attend (docs/design.md, "Estimators"). The host store runs each estimator's kernel
(xla_ffi/estimator_*.h); its decode-path strategy here prepares what the store is handed:

  layer_matrix(layer)                 the layer's fixed operand (SimHash's projection), or None
  index(k_BKPD, valid_BKP, w)         a new pool's mean key mu_BKD and its codes operand
  append_codes(k_BKTD, mu_BKD, w)     the codes of keys appended to a pool of mean mu_BKD
  query_codes(q_BHD, w)               the codes operand of this step's queries
  stats()                             what the estimator reports beside the rows it reads
  runs_on_mesh                        whether it is tested under shard_map

Each estimator is one module here (the strategy and its pure-jnp reference), one header in
xla_ffi/ (its kernel) and one line of registration in each language. `simhash` is the paper's
("magicpig"); `proxy` scores every pool key by a quantized proxy and reads the best ("proxy").

Shape key: B batch   K kv heads   H query heads   P pool tokens   T appended tokens   D head dim
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax

from pigjax.config import ESTIMATORS, AttentionConfig


class Estimator(Protocol):
  runs_on_mesh: bool

  def layer_matrix(self, layer: int) -> jax.Array | None: ...
  def index(self, k_BKPD, valid_BKP, w) -> tuple[jax.Array, jax.Array]: ...
  def append_codes(self, k_BKTD, mu_BKD, w) -> jax.Array: ...
  def query_codes(self, q_BHD, w) -> jax.Array: ...
  def stats(self) -> dict: ...


_REGISTRY: dict[str, Callable[[AttentionConfig, int], Estimator]] = {}


def register(name: str):
  """Class decorator: `name`'s estimator is built as cls(attention_config, head_dim)."""
  def add(cls):
    if name not in ESTIMATORS:
      raise ValueError(f"estimator {name!r} is not one of config.ESTIMATORS {ESTIMATORS}; add it "
                       "there too, so configs can choose it.")
    _REGISTRY[name] = cls
    return cls
  return add


def names() -> tuple[str, ...]:
  """The registered estimators, in config.ESTIMATORS order."""
  return tuple(n for n in ESTIMATORS if n in _REGISTRY)


def create(a: AttentionConfig, head_dim: int) -> Estimator:
  """The strategy for `a.estimator` (validated by `config.validate_attention`)."""
  if a.estimator not in _REGISTRY:
    raise ValueError(f"attention.estimator={a.estimator!r} has no implementation; registered: "
                     f"{names()}.")
  return _REGISTRY[a.estimator](a, head_dim)


from pigjax.estimators import proxy, simhash  # noqa: E402,F401  (each registers itself)
