// The "proxy" pool estimator (docs/design.md, "Estimators"; kernels in proxy.h, jnp twin in
// pigjax/estimators/proxy.py): at insert, the centred keys quantized per channel into the pool's
// index; at attend, every pool key scored on the index, the top rows read and attended exactly,
// and the mean-V tail added.
//
// One estimator behind the interface of estimators.h. Pure C++: no XLA, no nanobind.
#ifndef PIGJAX_XLA_FFI_ESTIMATOR_PROXY_H_
#define PIGJAX_XLA_FFI_ESTIMATOR_PROXY_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "xla_ffi/errors.h"
#include "xla_ffi/operands.h"
#include "xla_ffi/pool.h"
#include "xla_ffi/proxy.h"
#include "xla_ffi/softmax.h"
#include "xla_ffi/store_config.h"
#include "xla_ffi/store_core.h"

namespace pigjax {

class ProxyEstimator : public EstimatorDefaults {
 public:
  static constexpr const char* kName = "proxy";
  // A pool's index and its statistics, set by the pool's first insert and kept for every later
  // one (appended keys are coded with them, clamped: estimators.quantize_with_stats), and the sum
  // of V for the tail's mean V.
  struct Index {
    std::vector<uint8_t> codes;   // [n, ProxyLayout::bytes]
    std::vector<float> lo, step;  // [D]
    std::vector<double> v_sum;    // [D]
  };

  static std::string CheckConfig(const StoreConfig& c) {
    if (c.proxy_bits < 1 || c.proxy_bits > 8) {
      return Str("proxy_bits must be in [1, 8], got ", c.proxy_bits, ".");
    }
    if (!(c.proxy_fraction > 0.f && c.proxy_fraction <= 1.f)) {
      return Str("proxy_fraction must be in (0, 1], got ", c.proxy_fraction, ".");
    }
    return "";
  }
  // No tables, so no code columns.
  static int64_t CodeColumns(const StoreConfig&) { return 0; }
  // The codes of every token, and lo, step (f32) and the V sum (f64) per channel.
  static uint64_t IndexBytes(const StoreConfig& c, CheckedSize& s) {
    const uint64_t cap = c.capacity, d = c.head_dim;
    return s.Add(s.Mul(cap, uint64_t(ProxyLayout(c.proxy_bits, c.head_dim).bytes)), d * 16);
  }
  // Per worker: the selection's buffer, a float per pool token. Cannot overflow: capacity < 2^31.
  static uint64_t ScratchBytes(const StoreConfig& c) { return uint64_t(c.capacity) * 4; }

  ProxyEstimator(const StoreConfig& c, size_t num_pools, int workers)
      : proxy_ops_(GetProxyOps()),
        layout_(c.proxy_bits, c.head_dim),
        index_(num_pools),
        workers_(workers) {}

  uint64_t Bytes() const {
    uint64_t b = 0;
    for (const Index& x : index_) {
      b += x.codes.capacity() + 4 * (x.lo.capacity() + x.step.capacity()) +
           8 * x.v_sum.capacity();
    }
    for (const auto& w : workers_) b += 4 * (w.select.capacity() + w.select_ids.capacity());
    return b + 4 * (item_w_.capacity() + item_sw_.capacity() + item_bias_.capacity() +
                    item_tail_.capacity() + score_.capacity()) + item_wq_.capacity();
  }
  void Clear(size_t pool) { index_[pool] = Index(); }

  // The index was centred on the first insert's mu: later keys are centred on it too.
  void Append(StoreCore& s, const InsertArgs& a, int64_t b, int64_t kvh, size_t pool,
              HeadPool& p, int64_t len) {
    const int64_t d = s.cfg.head_dim, hkv = s.cfg.num_kv_heads;
    if (p.n == 0) p.mu.assign(a.mu + (b * hkv + kvh) * d, a.mu + (b * hkv + kvh + 1) * d);
    IndexTokens(s.cfg, a, b, kvh, p, index_[pool], len);
  }

  std::string Attend(StoreCore& s, const AttendArgs& a, const AttendPlan& plan);

 private:
  struct Worker {
    std::vector<float> select;        // the selection's scores [>= pool]
    std::vector<int32_t> select_ids;  // the selection's ids [pool + 8]
  };

  void IndexTokens(const StoreConfig& c, const InsertArgs& a, int64_t b, int64_t kvh,
                   const HeadPool& p, Index& x, int64_t len) const;

  const ProxyOps& proxy_ops_;
  const ProxyLayout layout_;
  std::vector<Index> index_;     // per pool (StoreCore::PoolIndex)
  std::vector<Worker> workers_;  // per worker
  // Attend: per query head the scan's int8 weights [padded] and their scale, the bias, its
  // tail's lse, and the proxy scores of every pool token ([items, max pool]); item_w_ is the
  // float weights of one head before rounding [padded].
  std::vector<float> item_w_, item_sw_, item_bias_, item_tail_, score_;
  std::vector<int8_t> item_wq_;
};

// Appends the index codes of tokens [0, len) of (row b, kv head kvh) to x (p: the pool, rows
// not yet copied, p.n not yet advanced). The codes come from the operand's keys as float32 (not
// from the rows in the store dtype), centred on p.mu, as estimators.quantize_keys codes them. The
// pool's first insert sets lo and step per channel from its own keys (lo = min, step = (max -
// min) / levels; a constant channel gets step 1, code 0); later inserts (generated tokens moved
// into the pool) reuse them and clamp, so earlier codes stay valid and an append costs O(len).
inline void ProxyEstimator::IndexTokens(const StoreConfig& c, const InsertArgs& a, int64_t b,
                                        int64_t kvh, const HeadPool& p, Index& x,
                                        int64_t len) const {
  const ProxyLayout& l = layout_;
  const int64_t d = c.head_dim, tt = a.k_shape[2], n0 = p.n;
  const int64_t src0 = (b * c.num_kv_heads + kvh) * tt * d;
  if (n0 == 0) {
    std::vector<float> hi(d, -std::numeric_limits<float>::infinity());
    x.lo.assign(d, std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < len; ++j) {
      for (int64_t e = 0; e < d; ++e) {
        const float kc = ElementAsF32(a.k, a.k_dtype, src0 + j * d + e) - p.mu[e];
        x.lo[e] = std::min(x.lo[e], kc);
        hi[e] = std::max(hi[e], kc);
      }
    }
    // step = (hi - lo) * (1 / levels), as estimators.quantize_stats (1 / levels rounded once).
    const float inv_levels = static_cast<float>(1.0 / l.levels());
    x.step.assign(d, 1.f);
    for (int64_t e = 0; e < d; ++e) {
      if (hi[e] > x.lo[e]) x.step[e] = (hi[e] - x.lo[e]) * inv_levels;
    }
    x.v_sum.assign(d, 0.0);
  }
  GrowTo(x.codes, (n0 + len) * l.bytes, c.capacity * l.bytes);
  std::vector<float> kc(d), inv_step(d);
  for (int64_t e = 0; e < d; ++e) inv_step[e] = 1.f / x.step[e];
  for (int64_t j = 0; j < len; ++j) {
    for (int64_t e = 0; e < d; ++e) {
      kc[e] = ElementAsF32(a.k, a.k_dtype, src0 + j * d + e) - p.mu[e];
      x.v_sum[e] += ElementAsF32(a.v, a.v_dtype, src0 + j * d + e);
    }
    PackProxyCodes(l, kc.data(), x.lo.data(), inv_step.data(), x.codes.data() + (n0 + j) * l.bytes);
  }
}

// Per query head: proxy scores of every pool token (a scan of the index shared by the kv head's
// query heads), the top k_keep = ceil(fraction * n) by proxy score (every token tied with the
// k_keep-th is kept too, as the reference does) attended exactly, and the rest's softmax mass
// from their proxy scores with the pool's mean V as their value, merged by log-sum-exp. Output
// o, lse and count (rows read) as the magicpig attend returns them. Phases, each split over the
// thread pool: scan (kv heads x token blocks), select (query heads), exact attention (pieces of
// selected rows, merged in piece order, so a row's result does not depend on the batch).
inline std::string ProxyEstimator::Attend(StoreCore& s, const AttendArgs& a,
                                          const AttendPlan& plan) {
  const StoreConfig& c = s.cfg;
  const ProxyLayout& l = layout_;
  const int64_t bsz = a.slots_size, hq = plan.hq, d = c.head_dim, hkv = c.num_kv_heads;
  const int64_t group = plan.group, items = plan.items, dp = l.padded, max_n = plan.max_n;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const bool prof = s.profiling;
  auto pool_of = [&](int64_t i) -> HeadPool& { return s.Pool(s.ItemPool(a, plan, i)); };
  try {
    s.ReserveAttend(a, plan);
    item_w_.assign(dp, 0.f);
    item_wq_.assign(items * dp, int8_t{0});
    item_sw_.assign(items, 0.f);
    item_bias_.resize(items);
    item_tail_.resize(items);
    score_.resize(items * max_n);
  } catch (const std::bad_alloc&) {
    return "store_attend: out of host memory for the proxy scan's scratch.";
  }

  // Query constants: w = scale * q * step rounded to int8 with its power-of-two scale
  // (QuantizeQueryWeights), bias = scale * (q . lo + q . mu).
  for (int64_t i = 0; i < items; ++i) {
    const size_t pi = s.ItemPool(a, plan, i);
    const HeadPool& p = s.Pool(pi);
    const Index& x = index_[pi];
    float* q = s.item_q.data() + i * d;
    s.QueryAsF32(a, i, q);
    a.count[i] = 0;
    if (p.n == 0) continue;
    float q_lo = 0.f, q_mu = 0.f;
    for (int64_t e = 0; e < d; ++e) {
      item_w_[e] = scale * q[e] * x.step[e];
      q_lo += q[e] * x.lo[e];
      q_mu += q[e] * p.mu[e];
    }
    item_sw_[i] = QuantizeQueryWeights(l, item_w_.data(), item_wq_.data() + i * dp);
    item_bias_[i] = scale * (q_lo + q_mu);
  }

  // Scan: pieces of (row, kv head, block of tokens), each scoring the kv head's query heads.
  constexpr int64_t kScanBlock = 4096;
  struct ScanPiece {
    int64_t b, kvh, t0, t1;
  };
  std::vector<ScanPiece> scan;
  for (int64_t b = 0; b < bsz; ++b) {
    const int64_t n = s.Pool(a.layer, a.slots[b], 0).n;
    for (int64_t h = 0; h < hkv; ++h) {
      for (int64_t t0 = 0; t0 < n; t0 += kScanBlock) {
        scan.push_back({b, h, t0, std::min(n, t0 + kScanBlock)});
      }
    }
  }
  s.ParallelFor(static_cast<int64_t>(scan.size()), [&](int64_t j, int w) {
    const ScanPiece& sp = scan[j];
    const int64_t i0 = sp.b * hq + sp.kvh * group;  // the kv head's first query head
    const uint64_t t0 = prof ? NowNs() : 0;
    proxy_ops_.scores(l, index_[s.PoolIndex(a.layer, a.slots[sp.b], sp.kvh)].codes.data(), sp.t0,
                      sp.t1, item_wq_.data() + i0 * dp, item_sw_.data() + i0,
                      static_cast<int>(group), score_.data() + i0 * max_n, max_n);
    if (prof) {
      s.scratch[w].prof.lookup_ns += NowNs() - t0;
      s.scratch[w].prof.bytes += (sp.t1 - sp.t0) * l.bytes;
    }
  }, plan.inline_only);

  // Select: the k_keep-th largest proxy score tau; rows >= tau are read, the rest form the tail.
  const float neg_inf = -std::numeric_limits<float>::infinity();
  s.ParallelFor(items, [&](int64_t i, int w) {
    const HeadPool& p = pool_of(i);
    item_tail_[i] = neg_inf;
    if (p.n == 0) return;
    Worker& wk = workers_[w];
    Profile& pr = s.scratch[w].prof;
    const uint64_t t0 = prof ? NowNs() : 0;
    const float* sc = score_.data() + i * max_n;
    float tau = 0.f, z_rest = 0.f;
    const int64_t count = proxy_ops_.select(sc, p.n, ProxyKeepCount(c.proxy_fraction, p.n),
                                            wk.select, wk.select_ids, s.item_cand[i].data(), &tau,
                                            &z_rest);
    a.count[i] = static_cast<int32_t>(count);
    // Scores left out the head's bias (the same for every token): the tail's lse adds it back.
    if (c.proxy_tail && z_rest > 0.f) item_tail_[i] = item_bias_[i] + tau + std::log(z_rest);
    if (prof) {
      pr.score_ns += NowNs() - t0;  // the selection (magicpig: scoring)
      pr.heads += 1;
      pr.candidates += count;
      pr.bytes += count * TokenBytes(d, c.dtype);
    }
  }, plan.inline_only);

  // Exact attention over the selected rows, in pieces as the magicpig attend.
  s.pieces.Cut(a.count, items, d);
  s.pieces.Run(s.PieceFor(plan.inline_only), [&](const Pieces::Piece& pc, int w, float* o,
                                                 float& m, float& z) {
    const PoolView view = s.View(pool_of(pc.item));
    const float* q = s.item_q.data() + pc.item * d;
    const int32_t* cand = s.item_cand[pc.item].data() + pc.begin;
    float* sc = s.scratch[w].score.data();
    const uint64_t t0 = prof ? NowNs() : 0;
    if (c.dtype == DType::kF32) {
      AccumulateExact<float>(s.ops, q, d, view, cand, pc.end - pc.begin, scale, sc, o, m, z);
    } else if (c.dtype == DType::kBf16) {
      AccumulateExact<bf16>(s.ops, q, d, view, cand, pc.end - pc.begin, scale, sc, o, m, z);
    } else {
      AccumulateExact<int8_t>(s.ops, q, d, view, cand, pc.end - pc.begin, scale, sc, o, m, z);
    }
    if (prof) s.scratch[w].prof.softmax_ns += NowNs() - t0;
  });

  // Merge the pieces, then the tail: lse = logaddexp(lse_top, lse_rest),
  // o = exp(lse_top - lse) o_top + exp(lse_rest - lse) mean V (lsh.merge_attention).
  int64_t j = 0;
  for (int64_t i = 0; i < items; ++i) {
    float* o = a.o + i * d;
    j = s.pieces.Merge(i, j, o, &a.lse[i]);
    const float lse_rest = item_tail_[i];
    if (lse_rest == neg_inf) continue;
    const HeadPool& p = pool_of(i);
    const Index& x = index_[s.ItemPool(a, plan, i)];
    const float lse_top = a.lse[i];
    const float hi = std::max(lse_top, lse_rest);
    const float lse = hi + std::log1p(std::exp(std::min(lse_top, lse_rest) - hi));
    const float w_top = lse_top == neg_inf ? 0.f : std::exp(lse_top - lse);
    const float w_rest = std::exp(lse_rest - lse);
    const double inv_n = 1.0 / static_cast<double>(p.n);
    for (int64_t e = 0; e < d; ++e) {
      o[e] = w_top * o[e] + w_rest * static_cast<float>(x.v_sum[e] * inv_n);
    }
    a.lse[i] = lse;
  }
  return "";
}

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_ESTIMATOR_PROXY_H_
