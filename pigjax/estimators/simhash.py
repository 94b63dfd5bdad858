"""The paper's estimator ("magicpig"): SimHash tables over the centred pool keys, candidates that
collide with the query in at least two tables, importance weights -log u_i (docs/design.md, "The
algorithm", steps 2-8). The host store builds the tables and samples (xla_ffi/estimator_magicpig.h);
this strategy hashes keys and queries in JAX (`pigjax.lsh`). Its pure-jnp reference is
`pigjax.reference.pool_attention_ref`.

Shape key: B batch   K kv heads   H query heads   P pool tokens   T appended tokens   D head dim
  L hash tables
"""

from __future__ import annotations

import jax.numpy as jnp

from pigjax import lsh
from pigjax.config import AttentionConfig
from pigjax.estimators import register


@register("magicpig")
class SimHashEstimator:
  runs_on_mesh = True

  def __init__(self, a: AttentionConfig, head_dim: int):
    self.a, self.head_dim = a, head_dim

  def layer_matrix(self, layer: int):
    """The layer's SimHash projection [D, num_bits * num_tables]."""
    a = self.a
    return lsh.simhash_matrix(a.seed, layer, self.head_dim, a.num_bits, a.num_tables,
                              a.per_layer_hash)

  def index(self, k_BKPD, valid_BKP, w):
    """(mu_BKD, codes_BKPL): the pool's mean key and the codes of its centred keys."""
    return lsh.centre_and_hash(k_BKPD, valid_BKP, w, self.a.num_bits, self.a.num_tables)

  def append_codes(self, k_BKTD, mu_BKD, w):
    """codes_BKTL of keys joining a pool of mean mu_BKD (centred on it, as the pool was)."""
    return lsh.hash_codes(k_BKTD.astype(jnp.float32) - mu_BKD[:, :, None], w, self.a.num_bits,
                          self.a.num_tables)

  def query_codes(self, q_BHD, w):
    """codes_BHL of the (uncentred) queries."""
    return lsh.hash_codes(q_BHD, w, self.a.num_bits, self.a.num_tables)

  def stats(self) -> dict:
    return {}
