"""Pool policies for the quality harness: one device-resident backend, one `pool_policy` switch.

Every policy keeps the same exact part as MagicPIG (docs/design.md, "The algorithm", step 1: the
first `sink` prompt tokens, the last `window` prompt tokens and every generated token) and the
same dense layers; only what is attended in the *pool* (prompt positions [sink, n - window))
differs (QUALITY.md, "Method"):

  dense      the whole pool                                   (full attention, the reference)
  magicpig   the configured estimator (attention.estimator): "magicpig" = the LSH-sampled,
             importance-weighted set (reference.pool_attention_ref, paper sections 3-5); "proxy" =
             score-proxy top-k of attention.proxy_fraction of the pool with a tail estimate
             (proxy.proxy_attention_ref)
  proxy      score-proxy top-k (proxy.proxy_attention_ref) reading exactly `k_keep` rows,
             bits and tail from attention.proxy_bits / proxy_tail (matched like topk)
  topk       the exact top-`k_keep` pool keys by score per query head (oracle, reference.topk_...)
  quest      top `n_pages` pages of 16 pool tokens by the page bound
             sum_d max(q_d min_d, q_d max_d) (Quest, arXiv 2406.10774, section 3)
  streaming  nothing: sink + window only (StreamingLLM, arXiv 2309.17453)

`PoolPolicyBackend` follows the `pigjax.engine.Engine` backend protocol (create_cache,
prefill_attend, decode_attend, after_prefill, after_step, stats), so Engine-driven decoding works
with every policy. By default every generated token stays exact; with `pool_generated` the older
half of a full generated buffer (attention.generated_buffer) joins the pool, hashed with the
prompt pool's mean key, exactly as the FFI backend's `MagicPigBackend.after_step` does, so long
generations can be checked against this reference (scripts/soak.py). The pool stays in the device
cache and is selected by a mask, which is simple and exact but not fast: this backend measures
quality, the FFI backend (`pigjax.magicpig`) speed.

In *probe* mode (a traced flag in the cache) every sparse layer also computes dense attention,
returns the dense output (so the activations stay the dense model's) and accumulates the squared
error of the policy's output against it per layer: the attention-output-error measure on real
activations.

Shape key:
  B batch   T tokens in this call   S cache positions   H query heads   K kv heads
  G query heads per kv head   D head dim   L hash tables   P pages   Y sparse layers
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pigjax import attention, lsh, reference
from pigjax.estimators import proxy
from pigjax.config import Config

POLICIES = ("dense", "magicpig", "topk", "proxy", "quest", "streaming")
PAGE = 16  # Quest's page size


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PolicyCache:
  k: tuple  # per layer [B, K, S, D] (the full dense cache; sparse layers mask it)
  v: tuple
  lengths_B: jax.Array  # int32 tokens seen per slot
  pool_end_B: jax.Array  # int32: the prompt's pool is positions [sink, pool_end)
  prompt_len_B: jax.Array  # int32 prompt tokens per slot: generated tokens start here
  gen_pooled: jax.Array  # int32 scalar: generated tokens moved into the pool (pool_generated)
  gen_count: jax.Array  # int32 scalar: generated tokens in the exact buffer
  mu: tuple  # magicpig: per sparse layer [B, K, D] pool mean key; else None
  codes: tuple  # magicpig: per sparse layer [B, K, S, L] codes of k - mu; else None
  page_min: tuple  # quest: per sparse layer [B, K, P, D]; else None
  page_max: tuple
  index: tuple  # proxy: per sparse layer proxy.ProxyIndex of the pool; else None
  vbar: tuple  # proxy: per sparse layer [B, K, D] pool mean value; else None
  probe: jax.Array  # bool scalar: return dense outputs and accumulate the error below
  err2_BY: jax.Array  # f32 per slot and sparse layer: sum over steps of |o_policy - o_dense|^2
  ref2_BY: jax.Array  # f32 likewise: sum of |o_dense|^2
  cand_total: jax.Array  # f32 pool keys attended, summed over steps, sparse layers, heads, slots
  pool_total: jax.Array  # f32 pool keys available, summed likewise


class PoolPolicyBackend:
  """Device-resident pool with a switchable pool policy (see the module docstring).

  Args:
    cfg: sink, window, dense_layers, and for magicpig num_bits, num_tables, seed,
      per_layer_hash come from cfg.attention.
    pool_policy: one of POLICIES.
    k_keep: topk's kept pool keys per query head.
    n_pages: quest's kept pages per query head.
    pool_generated: move the older half of a full generated buffer into the pool (the FFI
      backend's behaviour); dense, streaming, topk and the magicpig estimator only, as the other
      policies' pool indexes (Quest pages, proxy codes) are built once at prefill.
  """

  # The step protocol's own programs: none ahead of time. after_prefill's program is compiled
  # lazily by jax.jit, so the Engine counts it as prefill time.
  programs = None

  def __init__(self, cfg: Config, pool_policy: str, *, k_keep: int = 0, n_pages: int = 0,
               pool_generated: bool = False):
    if pool_policy not in POLICIES:
      raise ValueError(f"Unknown pool_policy {pool_policy!r}; use one of {POLICIES}.")
    if pool_policy in ("topk", "proxy") and k_keep < 1:
      raise ValueError(f"{pool_policy} needs k_keep >= 1, got {k_keep}.")
    if pool_policy == "quest" and n_pages < 1:
      raise ValueError(f"quest needs n_pages >= 1, got {n_pages}.")
    a, m = cfg.attention, cfg.model
    self.cfg, self.policy, self.k_keep, self.n_pages = cfg, pool_policy, k_keep, n_pages
    # The pool rule actually run: "magicpig" follows attention.estimator.
    self.rule = cfg.attention.estimator if pool_policy == "magicpig" else pool_policy
    self.sparse_layers = [l for l in range(m.num_layers) if l not in set(a.dense_layers)]
    self.sparse_index = {l: i for i, l in enumerate(self.sparse_layers)}
    if pool_generated and (self.rule == "proxy" or pool_policy == "quest"):
      raise ValueError(f"pool_generated is not supported by the {self.rule!r} rule: its pool "
                       "index is built once at prefill.")
    self.pool_generated = pool_generated
    self._after_prefill = jax.jit(self._split)
    self._evict = jax.jit(self._evict_generated, donate_argnums=(0,))

  # -- engine protocol ----------------------------------------------------------------------

  def create_cache(self, batch: int, max_len: int, dtype) -> attention.DenseCache:
    m = self.cfg.model
    return attention.DenseCache.create(m.num_layers, batch, m.num_kv_heads, max_len, m.head_dim,
                                       dtype)

  prefill_attend = staticmethod(attention.dense_attend)

  def after_prefill(self, cache: attention.DenseCache, lengths_B=None) -> PolicyCache:
    """Builds the policy's cache; `cache` is not donated (the harness reuses one prefill)."""
    return self._after_prefill(cache)

  def after_step(self, cache: PolicyCache) -> PolicyCache:
    if not self.pool_generated or int(cache.gen_count) < self.cfg.attention.generated_buffer:
      return cache
    return self._evict(cache)

  def stats(self, cache) -> dict:
    if not isinstance(cache, PolicyCache) or float(cache.pool_total) == 0:
      return {"pool_fraction": 0.0}
    return {"pool_fraction": float(cache.cand_total) / float(cache.pool_total)}

  def decode_attend(self, layer: int, q_BTHD, k_BTKD, v_BTKD, cache: PolicyCache):
    if layer not in self.sparse_index:
      return attention.dense_attend(layer, q_BTHD, k_BTKD, v_BTKD, cache)
    a = self.cfg.attention
    y = self.sparse_index[layer]
    k_BKSD = attention.write_kv(cache.k[layer], k_BTKD, cache.lengths_B)
    v_BKSD = attention.write_kv(cache.v[layer], v_BTKD, cache.lengths_B)
    S = k_BKSD.shape[2]
    pos_S = jnp.arange(S)
    pool_BS = (pos_S[None] >= a.sink) & (pos_S[None] < cache.pool_end_B[:, None])
    gen_end_B = cache.prompt_len_B + cache.gen_pooled
    pool_BS |= (pos_S[None] >= cache.prompt_len_B[:, None]) & (pos_S[None] < gen_end_B[:, None])
    seen_BS = pos_S[None] <= cache.lengths_B[:, None]
    q_BHD = q_BTHD[:, 0]
    o_ex_BTHD, lse_ex_BTH = attention.attend_with_lse(q_BTHD, k_BKSD, v_BKSD,
                                                      (seen_BS & ~pool_BS)[:, None])
    o_pool_BHD, lse_pool_BH, count_BH = self._pool(q_BHD, k_BKSD, v_BKSD, pool_BS, cache, y)
    o_BHD, _ = attention.merge_attention(o_ex_BTHD[:, 0], lse_ex_BTH[:, 0], o_pool_BHD, lse_pool_BH)

    o_dense_BTHD, _ = attention.attend_with_lse(q_BTHD, k_BKSD, v_BKSD, seen_BS[:, None])
    o_dense_BHD = o_dense_BTHD[:, 0]
    err2_B = jnp.sum(jnp.square(o_BHD - o_dense_BHD), axis=(1, 2))
    ref2_B = jnp.sum(jnp.square(o_dense_BHD), axis=(1, 2))
    H = q_BHD.shape[1]
    pool_len_B = jnp.sum(pool_BS, axis=-1, dtype=jnp.float32)
    cache = dataclasses.replace(
        cache, k=attention.replace_at(cache.k, layer, k_BKSD),
        v=attention.replace_at(cache.v, layer, v_BKSD),
        err2_BY=cache.err2_BY.at[:, y].add(err2_B), ref2_BY=cache.ref2_BY.at[:, y].add(ref2_B),
        cand_total=cache.cand_total + jnp.sum(count_BH, dtype=jnp.float32),
        pool_total=cache.pool_total + H * jnp.sum(pool_len_B))
    if layer == self.sparse_layers[-1]:  # once per step, as MagicPigBackend counts
      cache = dataclasses.replace(cache, gen_count=cache.gen_count + 1)
    out_BHD = jnp.where(cache.probe, o_dense_BHD, o_BHD)
    return out_BHD[:, None].astype(q_BTHD.dtype), cache

  # -- the pool policies --------------------------------------------------------------------

  def _pool(self, q_BHD, k_BKSD, v_BKSD, pool_BS, cache: PolicyCache, y: int):
    """(o_pool_BHD, lse_pool_BH, count_BH): attention over the policy's subset of the pool."""
    a = self.cfg.attention
    B, H, _ = q_BHD.shape
    valid_BKS = jnp.broadcast_to(pool_BS[:, None], k_BKSD.shape[:3])
    n_pool_BH = jnp.broadcast_to(jnp.sum(pool_BS, axis=-1, dtype=jnp.int32)[:, None], (B, H))
    if self.policy == "dense":
      o, lse = reference.dense_attention_ref(q_BHD, k_BKSD, v_BKSD, valid_BKS)
      return o, lse, n_pool_BH
    if self.policy == "streaming":
      return (jnp.zeros(q_BHD.shape, jnp.float32), jnp.full((B, H), -jnp.inf, jnp.float32),
              jnp.zeros((B, H), jnp.int32))
    if self.rule == "proxy":
      S = k_BKSD.shape[2]
      if self.policy == "proxy":  # a fixed row count (matched to another method's fraction)
        k_keep_B, k_max = jnp.minimum(n_pool_BH[:, 0], self.k_keep), self.k_keep
      else:  # attention.proxy_fraction of each slot's pool
        k_keep_B = proxy.keep_count(a.proxy_fraction, n_pool_BH[:, 0])
        k_max = int(np.ceil(a.proxy_fraction * S))
      return proxy.proxy_attention_ref(q_BHD, k_BKSD, v_BKSD, valid_BKS, cache.index[y],
                                            cache.vbar[y], k_keep_B, k_max, tail=a.proxy_tail)
    if self.policy == "magicpig":
      w = self._hash_matrix(self.sparse_layers[y])
      return reference.pool_attention_ref(q_BHD, k_BKSD, v_BKSD, valid_BKS, cache.mu[y], w,
                                    a.num_bits, a.num_tables, codes_BKTL=cache.codes[y])
    if self.policy == "topk":
      o, lse = reference.topk_attention_ref(q_BHD, k_BKSD, v_BKSD, valid_BKS, self.k_keep)
      return o, lse, jnp.minimum(n_pool_BH, self.k_keep)
    return self._quest(q_BHD, k_BKSD, v_BKSD, valid_BKS, cache.page_min[y], cache.page_max[y])

  def _quest(self, q_BHD, k_BKSD, v_BKSD, valid_BKS, min_BKPD, max_BKPD):
    """Quest: keep the n_pages pages with the largest upper bound on q . k (per query head)."""
    a = self.cfg.attention
    q_BKGD = reference.group_heads(q_BHD, k_BKSD.shape[1])
    bound_BKGP = jnp.sum(jnp.maximum(q_BKGD[:, :, :, None] * min_BKPD[:, :, None],
                                     q_BKGD[:, :, :, None] * max_BKPD[:, :, None]), axis=-1)
    page_ok_BKP = jnp.isfinite(min_BKPD[..., 0])
    bound_BKGP = jnp.where(page_ok_BKP[:, :, None], bound_BKGP, -jnp.inf)
    P = bound_BKGP.shape[-1]
    n = min(self.n_pages, P)
    top_idx_BKGN = jax.lax.top_k(bound_BKGP, n)[1]
    keep_BKGP = jnp.zeros(bound_BKGP.shape, bool).at[
        jnp.arange(bound_BKGP.shape[0])[:, None, None, None],
        jnp.arange(bound_BKGP.shape[1])[None, :, None, None],
        jnp.arange(bound_BKGP.shape[2])[None, None, :, None], top_idx_BKGN].set(True)
    keep_BKGP = keep_BKGP & page_ok_BKP[:, :, None]
    S = k_BKSD.shape[2]
    page_S = jnp.clip((jnp.arange(S) - a.sink) // PAGE, 0, P - 1)
    keep_BKGS = jnp.take(keep_BKGP, page_S, axis=-1) & valid_BKS[:, :, None]
    s_BKGS = reference.head_scores(q_BKGD, k_BKSD, None)
    o_BKGD, lse_BKG = reference.masked_attention(s_BKGS, keep_BKGS, v_BKSD)
    o_BHD, lse_BH = reference.ungroup_heads(o_BKGD, lse_BKG)
    b, k, g, s = keep_BKGS.shape
    return o_BHD, lse_BH, jnp.sum(keep_BKGS.reshape(b, k * g, s), axis=-1, dtype=jnp.int32)

  def _evict_generated(self, cache: PolicyCache) -> PolicyCache:
    """Moves the oldest generated_buffer // 2 exact generated tokens into the pool; the
    magicpig estimator hashes their keys centred on the prompt pool's mean (as the store does)."""
    a = self.cfg.attention
    E = a.generated_buffer // 2
    B = cache.lengths_B.shape[0]
    idx_BE = (cache.prompt_len_B + cache.gen_pooled)[:, None] + jnp.arange(E)[None]
    codes = list(cache.codes)
    if self.policy == "magicpig":
      for y, layer in enumerate(self.sparse_layers):
        k_BKED = jnp.take_along_axis(cache.k[layer], idx_BE[:, None, :, None], axis=2)
        new_BKEL = lsh.hash_codes(k_BKED.astype(jnp.float32) - cache.mu[y][:, :, None],
                                  self._hash_matrix(layer), a.num_bits, a.num_tables)
        K = k_BKED.shape[1]
        codes[y] = cache.codes[y].at[jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None],
                                     idx_BE[:, None, :]].set(new_BKEL)
    return dataclasses.replace(cache, codes=tuple(codes), gen_pooled=cache.gen_pooled + E,
                               gen_count=cache.gen_count - E)

  # -- after prefill ------------------------------------------------------------------------

  def _hash_matrix(self, layer: int):
    a, m = self.cfg.attention, self.cfg.model
    return lsh.simhash_matrix(a.seed, layer, m.head_dim, a.num_bits, a.num_tables,
                              a.per_layer_hash)

  def _split(self, dense: attention.DenseCache) -> PolicyCache:
    a = self.cfg.attention
    n_B = dense.lengths_B
    pool_end_B = jnp.where(n_B > a.sink + a.window, n_B - a.window, a.sink).astype(jnp.int32)
    S = dense.max_len
    pos_S = jnp.arange(S)
    pool_BS = (pos_S[None] >= a.sink) & (pos_S[None] < pool_end_B[:, None])
    mu, codes, pmin, pmax, index, vbar = [], [], [], [], [], []
    for layer in self.sparse_layers:
      k_BKSD = dense.k[layer].astype(jnp.float32)
      valid_BKS = jnp.broadcast_to(pool_BS[:, None], k_BKSD.shape[:3])
      if self.rule == "proxy":
        index.append(proxy.build_index(k_BKSD, valid_BKS, a.proxy_bits))
        mu.append(index[-1].mu)
        vbar.append(proxy.pool_mean_values(dense.v[layer], valid_BKS))
      elif self.policy == "magicpig":
        m_, c_ = lsh.centre_and_hash(k_BKSD, valid_BKS, self._hash_matrix(layer), a.num_bits,
                                     a.num_tables)
        mu.append(m_), codes.append(c_)
      if self.policy == "quest":
        lo, hi = _page_bounds(k_BKSD, valid_BKS, a.sink)
        pmin.append(lo), pmax.append(hi)
    Y = len(self.sparse_layers)
    none = lambda xs: tuple(xs) if xs else tuple(None for _ in self.sparse_layers)
    return PolicyCache(
        k=tuple(dense.k), v=tuple(dense.v), lengths_B=n_B, pool_end_B=pool_end_B,
        prompt_len_B=n_B, gen_pooled=jnp.int32(0), gen_count=jnp.int32(0), mu=none(mu),
        codes=none(codes), page_min=none(pmin), page_max=none(pmax), index=none(index), vbar=none(vbar),
        probe=jnp.bool_(False),
        err2_BY=jnp.zeros((n_B.shape[0], Y), jnp.float32),
        ref2_BY=jnp.zeros((n_B.shape[0], Y), jnp.float32),
        cand_total=jnp.float32(0), pool_total=jnp.float32(0))


def _page_bounds(k_BKSD, valid_BKS, sink: int):
  """Elementwise min/max of the valid keys of each 16-token pool page (pages start at `sink`);
  pages without a valid key get +inf/-inf."""
  B, K, S, D = k_BKSD.shape
  k = k_BKSD[:, :, sink:]
  valid = valid_BKS[:, :, sink:]
  P = -(-(S - sink) // PAGE)
  pad = P * PAGE - (S - sink)
  k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
  valid = jnp.pad(valid, ((0, 0), (0, 0), (0, pad)))[..., None]
  k_BKPQD = k.reshape(B, K, P, PAGE, D)
  valid = valid.reshape(B, K, P, PAGE, 1)
  lo = jnp.min(jnp.where(valid, k_BKPQD, jnp.inf), axis=3)
  hi = jnp.max(jnp.where(valid, k_BKPQD, -jnp.inf), axis=3)
  return lo, hi


def set_probe(cache: PolicyCache, on: bool) -> PolicyCache:
  return dataclasses.replace(cache, probe=jnp.bool_(on))


def layer_errors(cache: PolicyCache) -> np.ndarray:
  """[B, Y]: per slot and sparse layer, sqrt(sum |o - o_dense|^2 / sum |o_dense|^2) over the
  probed steps."""
  err2, ref2 = np.asarray(cache.err2_BY), np.asarray(cache.ref2_BY)
  return np.sqrt(err2 / np.maximum(ref2, 1e-30))
