"""Sharding over a device mesh: where parameters and caches live, and the host store's FFI calls
run per device (docs/scaling.md).

The mesh has two axes. "data" splits the batch slots; "model" splits the KV heads (each with its
query heads), the MLP's gate/up columns and down rows, and the vocabulary of the embedding and
the LM head. Parameters and caches are placed with `NamedSharding` and XLA's partitioner inserts
the collectives (an all-reduce after the attention output and MLP down projections).

An XLA custom call has no partitioning rule, so outside `shard_map` its operands would be
all-gathered onto every device. MagicPIG's `store_insert` / `store_attend` therefore run inside
`jax.shard_map`: each device's call sees only its own slots and KV heads, and talks to its own
host store (one per (data, model) coordinate, sized for the local slots and heads), named by a
[data, model] array of handles of which every device holds its own entry.

With the default 1 x 1 mesh `Sharding.active` is False and every method is the identity or the
plain single-device call, so the one-device path is unchanged.

Shape key: B batch rows   K kv heads   H query heads   T tokens   D head dim   L tables
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pigjax.config import MeshConfig, ModelConfig

DATA, MODEL = "data", "model"

# Parameter name -> its PartitionSpec (names as in pigjax.model; anything else is replicated).
_PARAM_SPECS = {
    "q_EHD": P(None, MODEL, None), "k_EKD": P(None, MODEL, None), "v_EKD": P(None, MODEL, None),
    "o_HDE": P(MODEL, None, None),
    "gate_EF": P(None, MODEL), "up_EF": P(None, MODEL), "down_FE": P(MODEL, None),
    "embed_VE": P(MODEL, None), "lm_head_EV": P(None, MODEL),
}
# Cache field -> its PartitionSpec (fields of attention.DenseCache and magicpig.MagicPigCache).
_CACHE_SPECS = {
    "k": P(DATA, MODEL), "v": P(DATA, MODEL), "mu": P(DATA, MODEL), "handle": P(DATA, MODEL),
    "lengths_B": P(DATA), "exact_pos_BX": P(DATA), "pool_len_B": P(DATA),
}  # others replicated: MagicPIG's [B] counters are read on the host (every process) each step


def validate_mesh(mc: MeshConfig, m: ModelConfig | None = None,
                  num_devices: int | None = None) -> None:
  """Raises ValueError naming the first mesh setting that cannot work."""
  if mc.data < 1 or mc.model < 1:
    raise ValueError(f"mesh.data and mesh.model must be >= 1, got {mc.data} x {mc.model}.")
  if num_devices is not None and mc.data * mc.model != num_devices:
    raise ValueError(
        f"mesh.data x mesh.model = {mc.data} x {mc.model} = {mc.data * mc.model} devices, but jax "
        f"has {num_devices} (all processes together); for N CPU devices in one process start "
        f"with JAX_NUM_CPU_DEVICES=N (or jax.config.update('jax_num_cpu_devices', N) first).")
  if m is not None and mc.model > 1:
    for name, size in (("num_kv_heads", m.num_kv_heads), ("intermediate_size",
                       m.intermediate_size), ("vocab_size", m.vocab_size)):
      if size % mc.model:
        raise ValueError(f"mesh.model={mc.model} must divide the model's {name}={size} (the "
                         f"model axis splits KV heads, MLP columns and the vocabulary).")


def mesh_requested(mc: MeshConfig) -> bool:
  """Whether programs run on a mesh: one is configured, or several processes share the run."""
  return mc.data * mc.model > 1 or jax.process_count() > 1


class Sharding:
  """A mesh and the placement rules; with `mesh=None` (one device) everything is a no-op."""

  def __init__(self, mesh: Mesh | None):
    self.mesh = mesh

  @classmethod
  def create(cls, mc: MeshConfig, m: ModelConfig | None = None) -> Sharding:
    """The mesh `mc` asks for over every device of every process.

    1 x 1 is no mesh in a single process; under jax.distributed (several processes) it is a
    data axis over every device, so the batch is split over the processes.
    """
    validate_mesh(mc, m)
    if not mesh_requested(mc):
      return cls(None)
    devices = jax.devices()
    if mc.data * mc.model == 1:
      mc = MeshConfig(data=len(devices), model=1)
    validate_mesh(mc, m, len(devices))
    # jax.devices() lists each process's devices together, so a process holds whole rows of
    # the grid: the data axis crosses processes and the model axis (all-reduces) stays inside.
    return cls(Mesh(np.array(devices).reshape(mc.data, mc.model), (DATA, MODEL)))

  @property
  def active(self) -> bool:
    return self.mesh is not None

  @property
  def data(self) -> int:
    return self.mesh.shape[DATA] if self.active else 1

  @property
  def model(self) -> int:
    return self.mesh.shape[MODEL] if self.active else 1

  def named(self, spec: P) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  # -- placement ----------------------------------------------------------------------------

  def place_params(self, params):
    """Parameters (an nnx state) moved onto the mesh by `_PARAM_SPECS`."""
    if not self.active:
      return params

    def put(path, x):
      names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
      spec = _PARAM_SPECS.get(names[-1] if names else "", P())
      return _put_global(x, self.named(spec))
    return jax.tree_util.tree_map_with_path(put, params)

  def cache_shardings(self, cache) -> Any:
    """A NamedSharding per cache leaf (by field name, `_CACHE_SPECS`; others replicated)."""
    def spec(path, x):
      field = path[0].name if isinstance(path[0], jax.tree_util.GetAttrKey) else ""
      return self.named(_CACHE_SPECS.get(field, P()))
    return jax.tree_util.tree_map_with_path(spec, cache)

  def place_cache(self, cache):
    if not self.active:
      return cache
    return jax.tree.map(_put_global, cache, self.cache_shardings(cache))

  def constrain_cache(self, cache):
    """Inside a jitted program: keep the cache where `place_cache` put it, so every program
    that returns a cache returns it with the sharding the next program was compiled for."""
    if not self.active:
      return cache
    return jax.lax.with_sharding_constraint(cache, self.cache_shardings(cache))

  def constrain_rows(self, x):
    """Inside a jitted program: x split over "data" along its first axis."""
    return jax.lax.with_sharding_constraint(x, self.named(P(DATA))) if self.active else x

  def rows(self, local: np.ndarray) -> jax.Array:
    """A global array, split over "data" by rows, from this process's rows `local`."""
    if not self.active:
      return jnp.asarray(local)
    return jax.make_array_from_process_local_data(self.named(P(DATA)), np.asarray(local))

  def replicated(self, x) -> jax.Array:
    """x (the same value in every process) on every device of the mesh."""
    if not self.active:
      return x
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed PRNG keys travel as their data
      return jax.random.wrap_key_data(_put_global(jax.random.key_data(x), self.named(P())),
                                      impl=jax.random.key_impl(x))
    return _put_global(x, self.named(P()))

  def local_rows(self, x: jax.Array) -> np.ndarray:
    """This process's rows of a row-split global array, as numpy."""
    if not self.active or jax.process_count() == 1:
      return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.global_array_to_host_local_array(x, self.mesh, P(DATA)))

  # -- the host store, one per (data, model) coordinate -----------------------------------------

  def local_coords(self) -> list[tuple[int, int]]:
    """The (data, model) coordinates of this process's devices."""
    ids = np.vectorize(lambda d: d.id)(self.mesh.devices)
    return [tuple(int(i) for i in np.argwhere(ids == d.id)[0])
            for d in self.mesh.devices.flat if d.process_index == jax.process_index()]

  def handles(self, handle_at: dict[tuple[int, int], int]) -> jax.Array:
    """int32 [data, model] handles, each device holding the one of its own store."""
    def shard(index):
      i, j = index[0].start or 0, index[1].start or 0
      return np.full((1, 1), handle_at[(i, j)], np.int32)
    return jax.make_array_from_callback((self.data, self.model), self.named(P(DATA, MODEL)), shard)

  def store_insert(self, handle, layer: int, k_BKTD, v_BKTD, codes_BKTL, lengths_B,
                   mu_BKD) -> jax.Array:
    """`store.store_insert` of row b into slot b of its device's store; returns pool sizes."""
    from pigjax.store import store_insert
    if not self.active:
      slots_B = jnp.arange(k_BKTD.shape[0], dtype=jnp.int32)
      return store_insert(handle, layer, slots_B, k_BKTD, v_BKTD, codes_BKTL, lengths_B, mu_BKD)

    def local(h_11, k, v, codes, lengths, mu):
      slots = jnp.arange(k.shape[0], dtype=jnp.int32)
      return store_insert(h_11[0, 0], layer, slots, k, v, codes, lengths, mu)
    heads = P(DATA, MODEL)
    # Every model shard returns the same pool sizes (its own heads of the same rows); out_specs
    # P(DATA) keeps each device's own result as its buffer, so each attend below depends on the
    # insert of its own store.
    return self._shard_map(local, (heads, heads, heads, heads, P(DATA), heads), P(DATA))(
        handle, k_BKTD, v_BKTD, codes_BKTL, lengths_B, mu_BKD)

  def store_attend(self, handle, layer: int, q_BHD, q_codes_BHL,
                   dep_B) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`store.store_attend` of row b over slot b of its device's store."""
    from pigjax.store import store_attend
    if not self.active:
      slots_B = jnp.arange(q_BHD.shape[0], dtype=jnp.int32)
      return store_attend(handle, layer, slots_B, q_BHD, q_codes_BHL, dep_B)

    def local(h_11, q, codes, dep):
      slots = jnp.arange(q.shape[0], dtype=jnp.int32)
      return store_attend(h_11[0, 0], layer, slots, q, codes, dep)
    heads = P(DATA, MODEL)
    return self._shard_map(local, (heads, heads, heads, P(DATA)), (heads, heads, heads))(
        handle, q_BHD, q_codes_BHL, dep_B)

  def _shard_map(self, fn: Callable, in_specs, out_specs) -> Callable:
    # check_vma=False: the FFI results are not provably replicated over "model" (store_insert's
    # pool sizes are, by construction), and a custom call has no varying-axes rule.
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def _put_global(x, sharding: NamedSharding) -> jax.Array:
  """x (the same value in every process) placed with `sharding`, which may span processes."""
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  host = np.asarray(x)
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
