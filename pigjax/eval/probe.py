"""Estimator probe: attention-output error of pool estimators on captured real decode queries.

The quality harness runs whole decode steps per method, which costs minutes per variant. This
probe instead captures, once, the post-RoPE queries, keys and values of every layer of a dense
forward pass over real text (teacher-forced, so the last `num_queries` positions are exactly the
decode queries of the strict layout with dense activations), then evaluates any number of pool
estimators on them in numpy, per sparse layer, KV head and query, with the same split as the
harness: sink and window of the prompt exact, the queries' own tokens exact (the generated
buffer), the rest is the pool.

Cost accounting: for every estimator we report
  read      fraction of pool K/V rows read at full precision, per query head (every row counts,
            also the rows of a tail sample);
  index     bytes per pool token and KV head the estimator's index keeps (tables, sketches,
            quantized keys; not the K/V themselves);
  lookup    bytes of index read per pool token and KV head per decode step (ids walked in the
            buckets for LSH; the whole sketch for a scan).

Shape letters: T pool tokens, D head dim, G query heads of one KV head, Q queries, L tables.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pigjax.estimators import proxy

KV_ROW_BYTES = 2 * 2 * 64  # a bf16 K row + V row of head dim 64 (the store's layout)


@dataclasses.dataclass
class Capture:
  """Per layer: q [Q, H, D] of the last Q positions, k/v [N, K, D] of all N positions, and the
  mean |q| over the prompt's positions [H, D] (for channel calibration, known at prefill)."""
  q: list
  k: list
  v: list
  q_abs_mean: list
  prompt_len: int  # n: positions [0, n) are the prompt, [n, n + Q) the probed decode tokens


def save_capture(cap: Capture, path) -> None:
  arrays = {f"{name}{i}": x for name in ("q", "k", "v", "q_abs_mean")
            for i, x in enumerate(getattr(cap, name))}
  np.savez(path, prompt_len=cap.prompt_len, num_layers=len(cap.q), **arrays)


def load_capture(path) -> Capture:
  z = np.load(path)
  n = int(z["num_layers"])
  return Capture(*([z[f"{name}{i}"] for i in range(n)] for name in ("q", "k", "v", "q_abs_mean")),
                 prompt_len=int(z["prompt_len"]))


def capture(model, cfg, ids: list[int], num_queries: int) -> Capture:
  """One dense forward over `ids` (eager, float32), recording q/k/v per layer."""
  import jax.numpy as jnp

  from pigjax import attention

  n = len(ids) - num_queries
  qs, ks, vs, qabs = [], [], [], []
  m = cfg.model

  def attend(layer, q_BTHD, k_BTKD, v_BTKD, cache):
    qs.append(np.asarray(q_BTHD[0, n:], np.float32))
    qabs.append(np.asarray(jnp.mean(jnp.abs(q_BTHD[0, :n]), axis=0), np.float32))
    ks.append(np.asarray(k_BTKD[0], np.float32))
    vs.append(np.asarray(v_BTKD[0], np.float32))
    return attention.dense_attend(layer, q_BTHD, k_BTKD, v_BTKD, cache)

  cache = attention.DenseCache.create(m.num_layers, 1, m.num_kv_heads, len(ids), m.head_dim,
                                      jnp.float32)
  tokens = jnp.asarray([ids], jnp.int32)
  positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
  model(tokens, positions, attend, cache)
  return Capture(qs, ks, vs, qabs, n)


# -- attention pieces -----------------------------------------------------------------------

def softmax_part(s_T: np.ndarray, v_TD: np.ndarray, w_T: np.ndarray | None = None):
  """(o, lse) of exp(s) (times optional weights w) over the given rows; empty -> (0, -inf)."""
  if s_T.size == 0:
    return np.zeros(v_TD.shape[-1]), -np.inf
  m = s_T.max()
  e = np.exp(s_T - m) * (1.0 if w_T is None else w_T)
  z = e.sum()
  if z <= 0:
    return np.zeros(v_TD.shape[-1]), -np.inf
  return e @ v_TD / z, m + math.log(z)


def merge(o1, l1, o2, l2):
  l = np.logaddexp(l1, l2)
  w1 = 0.0 if l1 == -np.inf else math.exp(l1 - l)
  w2 = 0.0 if l2 == -np.inf else math.exp(l2 - l)
  return w1 * o1 + w2 * o2, l


# -- estimators -----------------------------------------------------------------------------
# Each estimator is built once per (layer, KV head) from the pool (`prepare`), then called per
# query vector: est(q_D) -> (o_D, lse, rows_read, lookup_bytes). Scores are scale * q . k on the
# raw keys, as in the harness.

class Oracle:
  """Exact top-k by true score (an upper bound for selection: it scores every key)."""
  name = "topk"

  def __init__(self, k_keep: int):
    self.k_keep = k_keep

  def index_bytes(self, d):
    return 0.0

  def prepare(self, k_TD, v_TD, ctx):
    self.k, self.v, self.scale = k_TD, v_TD, ctx["scale"]

  def __call__(self, q_D):
    s = self.k @ q_D * self.scale
    kk = min(self.k_keep, s.size)
    idx = np.argpartition(-s, kk - 1)[:kk]
    o, l = softmax_part(s[idx], self.v[idx])
    return o, l, kk, 0.0


def _simhash_codes(x_ND, w_DM, num_bits, num_tables):
  bits = (x_ND @ w_DM > 0).reshape(x_ND.shape[0], num_tables, num_bits).astype(np.int64)
  return (bits << np.arange(num_bits)).sum(-1)


def log_u_np(cos, num_bits, num_tables):
  """log of P(>= 2 of L tables collide), as lsh.log_collision_probability (float64)."""
  p = 1.0 - np.arccos(np.clip(cos, -1, 1)) / np.pi
  big_p = np.power(np.maximum(p, 1e-300), num_bits)
  lt = num_tables
  u = -np.expm1((lt - 1) * np.log1p(-np.minimum(big_p, 1 - 1e-15)) + np.log1p((lt - 1) * big_p))
  return np.log(np.maximum(u, 1e-30))


class MagicPig:
  """The paper's estimator (docs/design.md, "The algorithm", steps 5-8), numpy, float64."""

  def __init__(self, num_bits, num_tables):
    self.num_bits, self.num_tables = num_bits, num_tables
    self.name = f"magicpig({num_bits},{num_tables})"

  def index_bytes(self, d):
    return 4.0 * self.num_tables + 4.0  # one int32 id per table, plus |k~|

  def prepare(self, k_TD, v_TD, ctx):
    self.k, self.v, self.scale = k_TD, v_TD, ctx["scale"]
    self.mu = k_TD.mean(0)
    self.kc = k_TD - self.mu
    self.kn = np.linalg.norm(self.kc, axis=-1)
    self.w = ctx["simhash"](self.num_bits, self.num_tables)
    self.codes = _simhash_codes(self.kc, self.w, self.num_bits, self.num_tables)
    # Bucket sizes per table, for the ids a lookup walks.
    self.bucket = [np.bincount(self.codes[:, t], minlength=1 << self.num_bits)
                   for t in range(self.num_tables)]

  def __call__(self, q_D):
    qc = _simhash_codes(q_D[None], self.w, self.num_bits, self.num_tables)[0]
    hits = (self.codes == qc).sum(-1)
    cand = np.nonzero(hits >= 2)[0]
    walked = sum(int(self.bucket[t][qc[t]]) for t in range(self.num_tables))
    cos = self.kc[cand] @ q_D / np.maximum(np.linalg.norm(q_D) * self.kn[cand], 1e-30)
    s = self.k[cand] @ q_D * self.scale - log_u_np(cos, self.num_bits, self.num_tables)
    o, l = softmax_part(s, self.v[cand])
    return o, l, cand.size, 4.0 * walked


def quantize_keys(kc_TD: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per-channel uniform quantization of centred keys to 2^bits levels (min/max per channel):
  (lo, step, code), the dequantized keys being lo + code * step. The per-channel min/max are
  O(D) per head, not per token."""
  lo, hi = kc_TD.min(0), kc_TD.max(0)
  levels = (1 << bits) - 1
  step = np.where(hi > lo, (hi - lo) / levels, 1.0)
  return lo, step, np.clip(np.round((kc_TD - lo) / step), 0, levels)


class ProxyTopK:
  """Top-k by an approximate score from low-precision centred keys, exact attention over them.

  proxy "q{b}": every channel at b bits; "c{r}q{b}": the r channels with the largest
  mean|q_c| * mean|k~_c| (calibrated on the prompt's own queries, known at prefill, as Double
  Sparsity's offline channel calibration) at b bits. tail: "none" (drop the rest), "mean"
  (the rest's softmax mass from the proxy scores, its value the pool's mean V: no extra reads),
  "sample{m}" (Poisson sample of the rest with pi_i proportional to exp(proxy score), about m
  rows, Horvitz-Thompson weights 1/pi_i; the sampled rows are read and counted).
  """

  def __init__(self, proxy: str, k_keep: int, tail: str = "none", seed: int = 0):
    self.proxy, self.k_keep, self.tail = proxy, k_keep, tail
    self.rng = np.random.default_rng(seed)
    self.name = f"proxy[{proxy},{tail},k={k_keep}]"
    if proxy.startswith("c"):
      r, b = proxy[1:].split("q")
      self.channels, self.bits = int(r), int(b)
    else:
      self.channels, self.bits = None, int(proxy[1:])

  def index_bytes(self, d):
    return (self.channels or d) * self.bits / 8.0

  def prepare(self, k_TD, v_TD, ctx):
    self.k, self.v, self.scale = k_TD, v_TD, ctx["scale"]
    self.mu = k_TD.mean(0)
    kc = k_TD - self.mu
    self.vmean = v_TD.mean(0)
    if self.channels is not None:
      imp = ctx["q_abs_mean"] * np.abs(kc).mean(0)
      self.ch = np.sort(np.argsort(-imp)[:self.channels])
      self.lo, self.step, self.code = quantize_keys(kc[:, self.ch], self.bits)
    else:
      self.ch = None
      self.lo, self.step, self.code = quantize_keys(kc, self.bits)

  def __call__(self, q_D):
    qp = q_D if self.ch is None else q_D[self.ch]
    # Proxy score of every pool key: q . k~ approximated, plus the constant q . mu; the weights
    # scale * q * step rounded to int8 as the product's scan does (proxy.query_weights).
    wq, sw = proxy.query_weights(self.scale * qp * self.step, xp=np)
    sp = sw[0] * (self.code @ wq) + (qp @ self.lo + q_D @ self.mu) * self.scale
    t = sp.size
    kk = min(self.k_keep, t)
    top = np.argpartition(-sp, kk - 1)[:kk]
    s_top = self.k[top] @ q_D * self.scale
    o, l = softmax_part(s_top, self.v[top])
    read = kk
    lookup = float(self.index_bytes(q_D.size)) * t
    if self.tail == "none" or kk == t:
      return o, l, read, lookup
    rest = np.ones(t, bool)
    rest[top] = False
    rest_idx = np.nonzero(rest)[0]
    if self.tail == "mean":
      lt = sp[rest_idx].max() + math.log(np.exp(sp[rest_idx] - sp[rest_idx].max()).sum())
      o, l = merge(o, l, self.vmean, lt)
      return o, l, read, lookup
    m = float(self.tail[len("sample"):])
    w = np.exp(sp[rest_idx] - sp[rest_idx].max())
    pi = _poisson_probs(w, m)
    take = self.rng.random(pi.size) < pi
    idx = rest_idx[take]
    if idx.size:
      s_tail = self.k[idx] @ q_D * self.scale
      o2, l2 = softmax_part(s_tail, self.v[idx], 1.0 / pi[take])
      o, l = merge(o, l, o2, l2)
    return o, l, read + idx.size, lookup


def _poisson_probs(w: np.ndarray, m: float) -> np.ndarray:
  """Inclusion probabilities pi_i = min(1, c w_i) with sum pi = m (c found by a few fixed-point
  passes: probabilities capped at 1 free budget for the rest)."""
  m = min(m, w.size)
  c = m / w.sum()
  for _ in range(8):
    pi = np.minimum(1.0, c * w)
    capped = pi >= 1.0
    free = m - capped.sum()
    rest = w[~capped].sum()
    if free <= 0 or rest <= 0:
      break
    c = free / rest
  return np.minimum(1.0, c * w)


# -- the evaluation loop --------------------------------------------------------------------

def evaluate(cap: Capture, sink: int, window: int, sparse_layers, estimators, simhash,
             num_kv_heads: int) -> dict:
  """Runs every estimator on every sparse layer, KV head, query head and probed query.

  Args:
    simhash: simhash(layer, num_bits, num_tables) -> f32 [D, num_bits * num_tables].

  Returns {estimator name: {"layer_error": [...], "read": fraction of pool rows read per query
  head, "index_bytes": per pool token and KV head, "lookup_bytes": per pool token and KV head
  per step}}.
  """
  n = cap.prompt_len
  pool = slice(sink, n - window)
  t_pool = n - window - sink
  out = {}
  exact: dict = {}  # (layer, query, head) -> (o_ex, lse_ex, o_dense): shared by all estimators
  for est in estimators:
    err2, ref2, read, lookup, calls = [], [], 0.0, 0.0, 0
    for layer in sparse_layers:
      q_QHD, k_ND, v_ND = cap.q[layer], cap.k[layer], cap.v[layer]
      num_q, num_h, d = q_QHD.shape
      g_size = num_h // num_kv_heads
      scale = 1.0 / math.sqrt(d)
      e2 = r2 = 0.0
      for kv in range(num_kv_heads):
        k_TD = k_ND[:, kv].astype(np.float64)
        v_TD = v_ND[:, kv].astype(np.float64)
        heads = range(kv * g_size, (kv + 1) * g_size)
        ctx = {"scale": scale, "simhash": lambda b, l, layer=layer: np.asarray(
                   simhash(layer, b, l), np.float64),
               "q_abs_mean": cap.q_abs_mean[layer][list(heads)].mean(0)}
        est.prepare(k_TD[pool], v_TD[pool], ctx)
        lookup_kv = 0.0
        for j in range(num_q):
          ex = np.r_[0:sink, n - window:n + j + 1]
          for h in heads:
            q = q_QHD[j, h].astype(np.float64)
            if (layer, j, h) not in exact:
              exact[layer, j, h] = (*softmax_part(k_TD[ex] @ q * scale, v_TD[ex]),
                                    softmax_part(k_TD[:n + j + 1] @ q * scale, v_TD[:n + j + 1])[0])
            o_ex, l_ex, o_d = exact[layer, j, h]
            o_p, l_p, rows, lk = est(q)
            o, _ = merge(o_ex, l_ex, o_p, l_p)
            e2 += float(np.sum((o - o_d) ** 2))
            r2 += float(np.sum(o_d ** 2))
            read += rows / t_pool
            lookup_kv += lk
            calls += 1
        # A scan of the sketch serves all G query heads of the KV head: count it once per step.
        lookup += lookup_kv / (g_size if est.name.startswith("proxy") else 1)
      err2.append(e2), ref2.append(r2)
    errs = np.sqrt(np.array(err2) / np.maximum(np.array(ref2), 1e-30))
    steps = len(sparse_layers) * num_kv_heads * num_q
    out[est.name if not isinstance(est, Oracle) else f"topk({est.k_keep})"] = {
        "layer_error": errs.tolist(), "median_error": float(np.median(errs)),
        "mean_error": float(errs.mean()), "read": read / calls,
        "index_bytes": est.index_bytes(cap.q[0].shape[-1]),
        "lookup_bytes": lookup / steps / t_pool, "pool_tokens": t_pool}
  return out
