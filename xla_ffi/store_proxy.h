// The host store's proxy estimator (kernels in proxy.h, jnp twin in
// pigjax/estimators.py): the insert builds the index, the attend scans it, reads the top rows
// exactly and adds the mean-V tail. Included by store.h after the Store class.
#ifndef PIGJAX_XLA_FFI_STORE_PROXY_H_
#define PIGJAX_XLA_FFI_STORE_PROXY_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "xla_ffi/proxy.h"
#include "xla_ffi/store.h"

namespace pigjax {

// Appends the index codes of tokens [0, len) of (row b, kv head kvh) to p (rows already copied,
// p.n not yet advanced). The codes come from the operand's keys as float32 (not from the rows in
// the store dtype), centred on p.mu, as estimators.quantize_keys codes them. The pool's first
// insert sets lo and step per channel from its own keys (lo = min, step = (max - min) / levels;
// a constant channel gets step 1, code 0); later inserts (generated tokens moved into the pool)
// reuse them and clamp, so earlier codes stay valid and an append costs O(len).
inline void Store::IndexTokens(const InsertArgs& a, int64_t b, int64_t kvh, HeadPool& p,
                               int64_t len) {
  const ProxyLayout& l = layout_;
  const int64_t d = cfg_.head_dim, tt = a.k_shape[2], n0 = p.n;
  const int64_t src0 = (b * cfg_.num_kv_heads + kvh) * tt * d;
  auto read = [&](const void* x, DType t, int64_t s) {
    return t == DType::kF32 ? static_cast<const float*>(x)[s]
                            : ToF32(static_cast<const bf16*>(x)[s]);
  };
  if (n0 == 0) {
    std::vector<float> hi(d, -std::numeric_limits<float>::infinity());
    p.lo.assign(d, std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < len; ++j) {
      for (int64_t e = 0; e < d; ++e) {
        const float kc = read(a.k, a.k_dtype, src0 + j * d + e) - p.mu[e];
        p.lo[e] = std::min(p.lo[e], kc);
        hi[e] = std::max(hi[e], kc);
      }
    }
    // step = (hi - lo) * (1 / levels), as estimators.quantize_stats (1 / levels rounded once).
    const float inv_levels = static_cast<float>(1.0 / l.levels());
    p.step.assign(d, 1.f);
    for (int64_t e = 0; e < d; ++e) {
      if (hi[e] > p.lo[e]) p.step[e] = (hi[e] - p.lo[e]) * inv_levels;
    }
    p.v_sum.assign(d, 0.0);
  }
  GrowTo(p.codes, (n0 + len) * l.bytes, cfg_.capacity * l.bytes);
  std::vector<float> kc(d), inv_step(d);
  for (int64_t e = 0; e < d; ++e) inv_step[e] = 1.f / p.step[e];
  for (int64_t j = 0; j < len; ++j) {
    for (int64_t e = 0; e < d; ++e) {
      kc[e] = read(a.k, a.k_dtype, src0 + j * d + e) - p.mu[e];
      p.v_sum[e] += read(a.v, a.v_dtype, src0 + j * d + e);
    }
    PackProxyCodes(l, kc.data(), p.lo.data(), inv_step.data(), p.codes.data() + (n0 + j) * l.bytes);
  }
}

// Per query head: proxy scores of every pool token (a scan of the index shared by the kv head's
// query heads), the top k_keep = ceil(fraction * n) by proxy score (every token tied with the
// k_keep-th is kept too, as the reference does) attended exactly, and the rest's softmax mass
// from their proxy scores with the pool's mean V as their value, merged by log-sum-exp. Output
// o, lse and count (rows read) as the magicpig attend returns them. Phases, each split over the
// thread pool: scan (kv heads x token blocks), select (query heads), exact attention (pieces of
// selected rows, merged in piece order, so a row's result does not depend on the batch).
inline std::string Store::AttendProxy(const AttendArgs& a, bool inline_only) {
  const StoreConfig& c = cfg_;
  const ProxyLayout& l = layout_;
  const int64_t bsz = a.slots_size, hq = a.q_shape[1], d = c.head_dim, hkv = c.num_kv_heads;
  const int64_t group = hq / hkv, items = bsz * hq, dp = l.padded;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const bool prof = profiling_;
  auto pool_of = [&](int64_t i) -> HeadPool& {
    return Pool(a.layer, a.slots[i / hq], (i % hq) / group);
  };
  int64_t max_n = 0;
  for (int64_t b = 0; b < bsz; ++b) max_n = std::max(max_n, Pool(a.layer, a.slots[b], 0).n);
  try {
    for (auto& s : scratch_) s.score.resize(kAttentionScratch);
    if (item_cand_.size() < size_t(items)) item_cand_.resize(items);
    for (int64_t i = 0; i < items; ++i) {
      const int64_t n = pool_of(i).n;
      if (item_cand_[i].size() < size_t(n + kScanSlack)) item_cand_[i].resize(n + kScanSlack);
    }
    item_q_.resize(items * d);
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
    const HeadPool& p = pool_of(i);
    float* q = item_q_.data() + i * d;
    for (int64_t e = 0; e < d; ++e) {
      q[e] = a.q_dtype == DType::kF32 ? static_cast<const float*>(a.q)[i * d + e]
                                      : ToF32(static_cast<const bf16*>(a.q)[i * d + e]);
    }
    a.count[i] = 0;
    if (p.n == 0) continue;
    float q_lo = 0.f, q_mu = 0.f;
    for (int64_t e = 0; e < d; ++e) {
      item_w_[e] = scale * q[e] * p.step[e];
      q_lo += q[e] * p.lo[e];
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
    const int64_t n = Pool(a.layer, a.slots[b], 0).n;
    for (int64_t h = 0; h < hkv; ++h) {
      for (int64_t t0 = 0; t0 < n; t0 += kScanBlock) {
        scan.push_back({b, h, t0, std::min(n, t0 + kScanBlock)});
      }
    }
  }
  ParallelFor(static_cast<int64_t>(scan.size()), [&](int64_t j, int w) {
    const ScanPiece& sp = scan[j];
    const int64_t i0 = sp.b * hq + sp.kvh * group;  // the kv head's first query head
    const uint64_t t0 = prof ? NowNs() : 0;
    proxy_ops_.scores(l, Pool(a.layer, a.slots[sp.b], sp.kvh).codes.data(), sp.t0, sp.t1,
                      item_wq_.data() + i0 * dp, item_sw_.data() + i0, static_cast<int>(group),
                      score_.data() + i0 * max_n, max_n);
    if (prof) {
      scratch_[w].prof.lookup_ns += NowNs() - t0;
      scratch_[w].prof.bytes += (sp.t1 - sp.t0) * l.bytes;
    }
  }, inline_only);

  // Select: the k_keep-th largest proxy score tau; rows >= tau are read, the rest form the tail.
  const float neg_inf = -std::numeric_limits<float>::infinity();
  ParallelFor(items, [&](int64_t i, int w) {
    const HeadPool& p = pool_of(i);
    item_tail_[i] = neg_inf;
    if (p.n == 0) return;
    Scratch& s = scratch_[w];
    const uint64_t t0 = prof ? NowNs() : 0;
    const float* sc = score_.data() + i * max_n;
    float tau = 0.f, z_rest = 0.f;
    const int64_t count = proxy_ops_.select(sc, p.n, ProxyKeepCount(c.proxy_fraction, p.n),
                                            s.select, s.select_ids, item_cand_[i].data(), &tau,
                                            &z_rest);
    a.count[i] = static_cast<int32_t>(count);
    // Scores left out the head's bias (the same for every token): the tail's lse adds it back.
    if (c.proxy_tail && z_rest > 0.f) item_tail_[i] = item_bias_[i] + tau + std::log(z_rest);
    if (prof) {
      s.prof.score_ns += NowNs() - t0;  // the selection (magicpig: scoring)
      s.prof.heads += 1;
      s.prof.candidates += count;
      s.prof.bytes += count * TokenBytes(d, c.dtype);
    }
  }, inline_only);

  // Exact attention over the selected rows, in pieces as the magicpig attend.
  pieces_.Cut(a.count, items, d);
  pieces_.Run(PieceFor(inline_only), [&](const Pieces::Piece& pc, int w, float* o, float& m,
                                         float& z) {
    const HeadPool& p = pool_of(pc.item);
    const PoolView view = View(p);
    const float* q = item_q_.data() + pc.item * d;
    const int32_t* cand = item_cand_[pc.item].data() + pc.begin;
    float* sc = scratch_[w].score.data();
    const uint64_t t0 = prof ? NowNs() : 0;
    if (c.dtype == DType::kF32) {
      AccumulateExact<float>(ops_, q, d, view, cand, pc.end - pc.begin, scale, sc, o, m, z);
    } else if (c.dtype == DType::kBf16) {
      AccumulateExact<bf16>(ops_, q, d, view, cand, pc.end - pc.begin, scale, sc, o, m, z);
    } else {
      AccumulateExact<int8_t>(ops_, q, d, view, cand, pc.end - pc.begin, scale, sc, o, m, z);
    }
    if (prof) scratch_[w].prof.softmax_ns += NowNs() - t0;
  });

  // Merge the pieces, then the tail: lse = logaddexp(lse_top, lse_rest),
  // o = exp(lse_top - lse) o_top + exp(lse_rest - lse) mean V (lsh.merge_attention).
  int64_t j = 0;
  for (int64_t i = 0; i < items; ++i) {
    float* o = a.o + i * d;
    j = pieces_.Merge(i, j, o, &a.lse[i]);
    const float lse_rest = item_tail_[i];
    if (lse_rest == neg_inf) continue;
    const HeadPool& p = pool_of(i);
    const float lse_top = a.lse[i];
    const float hi = std::max(lse_top, lse_rest);
    const float lse = hi + std::log1p(std::exp(std::min(lse_top, lse_rest) - hi));
    const float w_top = lse_top == neg_inf ? 0.f : std::exp(lse_top - lse);
    const float w_rest = std::exp(lse_rest - lse);
    const double inv_n = 1.0 / static_cast<double>(p.n);
    for (int64_t e = 0; e < d; ++e) {
      o[e] = w_top * o[e] + w_rest * static_cast<float>(p.v_sum[e] * inv_n);
    }
    a.lse[i] = lse;
  }
  return "";
}

}  // namespace pigjax

#endif  // PIGJAX_XLA_FFI_STORE_PROXY_H_
