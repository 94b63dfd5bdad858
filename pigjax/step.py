"""The decode core: the model's prefill-chunk, first-token and decode-step functions over pytrees,
with one compile cache. `pigjax.engine.Engine` (offline batches), `pigjax.serving.batch.SlotBatch`
(continuous batching) and `pigjax.eval.runner.Runner` (teacher forcing) are drivers over it.

Every piece is a pure function `(params, cache, ...) -> (..., cache)`, compiled once per shape and
static setting and donating the cache, in the style of jax-llm-examples' `decode_step`. The
attention backend (dense in `pigjax.attention`, MagicPIG in `pigjax.magicpig`, the quality
harness's policies in `pigjax.eval.policies`) owns the cache layout; the core only runs the model
over it. Per-row state lives in [B] arrays, so the same functions serve rows that started
together (Engine) and rows admitted at different steps (serving).

Sampling is a strategy passed to `first_token` / `decode_step`: `UniformSampler` draws every row
with one `SamplingConfig` and one key (Engine); `RowSampler` gives each row its own parameters and
key (`sampling.RowSampling`, serving). Both are hashable values, so they key the compile cache.

Shape key: B rows   T tokens in this call   E hidden size   V vocabulary   S history positions
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pigjax import sampling
from pigjax.attention import DenseBackend
from pigjax.config import Config, SamplingConfig, validate_attention
from pigjax.model import Llama
from pigjax.sharding import Sharding


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def bucket(n: int, smallest: int) -> int:
  """The smallest power of two >= max(n, smallest): shapes bucketed so few programs compile."""
  return max(smallest, 1 << (n - 1).bit_length())


def kv_cache_dtype(cfg: Config, model_dtype) -> jnp.dtype:
  """The KV cache's dtype: `cfg.cache_dtype`, or the model's for "auto"."""
  return jnp.dtype(model_dtype if cfg.cache_dtype == "auto" else cfg.cache_dtype)


class Backend(Protocol):
  """What the drivers need from an attention backend (`attention.DenseBackend`,
  `magicpig.MagicPigBackend`, `eval.policies.PoolPolicyBackend`)."""
  programs: Programs  # the backend's own compiled programs (store maintenance), if any

  def create_cache(self, batch: int, max_len: int, dtype) -> Any: ...
  def prefill_attend(self, layer: int, q_BTHD, k_BTKD, v_BTKD, cache) -> tuple[Any, Any]: ...
  def decode_attend(self, layer: int, q_BTHD, k_BTKD, v_BTKD, cache) -> tuple[Any, Any]: ...
  def after_prefill(self, cache, lengths_B: np.ndarray) -> Any: ...
  def after_step(self, cache) -> Any: ...
  def stats(self, cache) -> dict: ...


class RowBackend(Backend, Protocol):
  """A backend whose decode cache takes rows one at a time (continuous batching)."""

  def init_running(self, batch: int, max_len: int, dtype) -> Any: ...
  def insert_row(self, running, single, slot) -> Any: ...
  def free_row(self, slot: int) -> None: ...
  def needs_maintenance(self, cache) -> bool: ...
  def maintain(self, cache, active_B) -> Any: ...
  def row_stats(self, cache) -> dict[str, jax.Array]: ...


def make_backend(cfg: Config) -> RowBackend:
  """The attention backend `cfg.attention.kind` names; both serve offline batches and rows."""
  validate_attention(cfg.attention)  # MagicPigBackend also bounds dense_layers by the model
  if cfg.attention.kind == "magicpig":  # every estimator runs in the host store
    from pigjax.magicpig import MagicPigBackend  # the host store is only built when asked for
    return MagicPigBackend(cfg)
  return DenseBackend(cfg)


class Programs:
  """A compile cache: each (name, static settings, operand shapes) is lowered and compiled ahead
  of time once, and the seconds spent compiling are counted (`compile_s`), so drivers report
  compile time apart from run time."""

  def __init__(self):
    self._compiled: dict[Any, Callable] = {}
    self.compile_s = 0.0

  def get(self, name: str, fn: Callable, *args, donate: tuple = (),
          static: tuple = ()) -> Callable:
    """The compiled `fn` for these operands; `static` names whatever else `fn` closes over."""
    leaves, treedef = jax.tree.flatten(args)
    key = (name, static, treedef, tuple((x.shape, x.dtype) for x in leaves))
    if key not in self._compiled:
      t0 = time.perf_counter()
      self._compiled[key] = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
      self.compile_s += time.perf_counter() - t0
    return self._compiled[key]

  def run(self, name: str, fn: Callable, *args, donate: tuple = (), static: tuple = ()):
    return self.get(name, fn, *args, donate=donate, static=static)(*args)

  def names(self) -> list[str]:
    """The name of every compiled program (one entry per shape and setting)."""
    return [k[0] for k in self._compiled]

  def compiled(self, name: str) -> list:
    """The compiled programs called `name` (for inspecting their HLO)."""
    return [c for k, c in self._compiled.items() if k[0] == name]

  def __len__(self) -> int:
    return len(self._compiled)


@dataclasses.dataclass(frozen=True)
class UniformSampler:
  """Every row drawn with one `SamplingConfig` and one key: operands (key, history_BS)."""
  sc: SamplingConfig

  def __call__(self, logits_BV, key, history_BS):
    sc = self.sc
    return sampling.sample(logits_BV, key, temperature=sc.temperature, top_k=sc.top_k,
                           top_p=sc.top_p, min_p=sc.min_p,
                           repetition_penalty=sc.repetition_penalty,
                           prev_tokens_BT=history_BS if sc.repetition_penalty != 1.0 else None)


@dataclasses.dataclass(frozen=True)
class RowSampler:
  """Each row with its own settings and key: operands (seeds_B, counters_B, rows, history_BS).
  `full` False is plain argmax for rows that are all greedy without penalty (history unused)."""
  full: bool

  def __call__(self, logits_BV, seeds_B, counters_B, rows: sampling.RowSampling, history_BS):
    return sampling.sample_rows(logits_BV, sampling.row_keys(seeds_B, counters_B), rows,
                                penalize=self.full, stochastic=self.full,
                                prev_tokens_BT=history_BS)


class StepCore:
  """The model's jitted pieces over one backend's caches.

  Args:
    cfg: the config (mesh, model shape).
    model: the loaded Llama; its parameters are split out (and placed on the mesh) once.
    backend: the attention backend whose caches the pieces read and write.
  """

  def __init__(self, cfg: Config, model: Llama, backend: Backend):
    self.cfg = cfg
    self.backend = backend
    self.dtype = model.dtype
    self.graphdef, params = nnx.split(model)
    # Under a mesh (cfg.mesh) the parameters and caches are placed on it (pigjax.sharding).
    self.sharding = Sharding.create(cfg.mesh, cfg.model)
    self.params = self.sharding.place_params(params)
    self.programs = Programs()

  @property
  def compile_s(self) -> float:
    """Seconds spent compiling, the core's programs and the backend's together."""
    own = getattr(self.backend, "programs", None)
    return self.programs.compile_s + (own.compile_s if own is not None else 0.0)

  def _forward(self, params, tokens_BT, cache, attend):
    model = nnx.merge(self.graphdef, params)
    T = tokens_BT.shape[1]
    positions_BT = cache.lengths_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    return model, model(tokens_BT, positions_BT, attend, cache)

  # -- the pure pieces (jit them through `programs`) ----------------------------------------

  def prefill_chunk(self, params, cache, tokens_BT, n_valid_B, last_hidden_BE):
    """Prefills one chunk (row b's first n_valid_B[b] tokens are real); keeps the hidden state
    of each row's last real token. Returns (cache, last_hidden_BE)."""
    model, (h_BTE, cache) = self._forward(params, tokens_BT, cache, self.backend.prefill_attend)
    idx_B = jnp.clip(n_valid_B - 1, 0, tokens_BT.shape[1] - 1)
    h_last_BE = jnp.take_along_axis(h_BTE, idx_B[:, None, None], axis=1)[:, 0]
    last_hidden_BE = jnp.where((n_valid_B > 0)[:, None], h_last_BE, last_hidden_BE)
    cache = dataclasses.replace(cache, lengths_B=cache.lengths_B + n_valid_B)
    return self.sharding.constrain_cache(cache), self.sharding.constrain_rows(last_hidden_BE)

  def first_logits(self, params, last_hidden_BE):
    """Next-token logits from the final hidden states of a prefill: logits_BV."""
    model = nnx.merge(self.graphdef, params)
    return model.logits(last_hidden_BE[:, None])[:, 0]

  def decode_logits(self, params, cache, tokens_B):
    """One decode step's forward: (logits_BV, cache) with tokens_B appended."""
    model, (h_B1E, cache) = self._forward(params, tokens_B[:, None], cache,
                                          self.backend.decode_attend)
    cache = dataclasses.replace(cache, lengths_B=cache.lengths_B + 1)
    return model.logits(h_B1E)[:, 0], self.sharding.constrain_cache(cache)

  def first_token(self, params, last_hidden_BE, *sample_args, sampler: Callable):
    """The first generated token of each row: tokens_B."""
    return self.sharding.constrain_rows(
        sampler(self.first_logits(params, last_hidden_BE), *sample_args))

  def decode_step(self, params, cache, tokens_B, *sample_args, sampler: Callable):
    """One decode step: (next tokens_B, cache)."""
    logits_BV, cache = self.decode_logits(params, cache, tokens_B)
    return self.sharding.constrain_rows(sampler(logits_BV, *sample_args)), cache
