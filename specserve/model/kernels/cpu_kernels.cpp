// CPU kernels for x86 (AVX2 + FMA), registered as torch ops specserve_cpu::*: weight-only quantized
// matmuls, paged attention, and the fused small ops of a decoder layer.
//
// y[M, N] = x[M, K] @ w.T with w stored in groups of 32 along K, as llama.cpp's Q4_1 / Q8_0 store them:
//   q4: packed [N, K / 2] uint8; in group g of row n, byte i holds code i (low nibble) and code i + 16
//       (high nibble); w = scale[n, g] * code + min[n, g], code in 0..15.
//   q8: codes [N, K] int8; w = scale[n, g] * code.
// Activations and accumulation are fp32; a group's weights are dequantized in registers (one FMA).
//
// NOTE: each output y[m, n] is summed by one thread in an order that depends only on K -- never on M, on
// the other rows, or on the thread count -- so the result of a row is the same in any batch (decode at 1
// row and verification at k + 1 rows agree bit for bit). The weight codes of a group are converted once
// and applied to up to kRowTile rows, so a k + 1-row verification reads the weights once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

constexpr int kGroup = 32;
constexpr int kRowTile = 8;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 bytes_to_float(__m128i b8) {  // 8 uint8 in the low half of b8 -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b8));
}

inline __m256 sbytes_to_float(__m128i b8) {  // 8 int8 -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8));
}

// The four 8-float vectors of one group's dequantized weights (scale * code + min), for both formats.
struct Q4Group {
  static void load(const uint8_t* p, __m256 s, __m256 m, __m256 w[4]) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
    w[0] = _mm256_fmadd_ps(bytes_to_float(lo), s, m);
    w[1] = _mm256_fmadd_ps(bytes_to_float(_mm_srli_si128(lo, 8)), s, m);
    w[2] = _mm256_fmadd_ps(bytes_to_float(hi), s, m);
    w[3] = _mm256_fmadd_ps(bytes_to_float(_mm_srli_si128(hi, 8)), s, m);
  }
  static constexpr int64_t bytes = kGroup / 2;
};

struct Q8Group {
  static void load(const uint8_t* p, __m256 s, __m256, __m256 w[4]) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
    w[0] = _mm256_mul_ps(sbytes_to_float(a), s);
    w[1] = _mm256_mul_ps(sbytes_to_float(_mm_srli_si128(a, 8)), s);
    w[2] = _mm256_mul_ps(sbytes_to_float(b), s);
    w[3] = _mm256_mul_ps(sbytes_to_float(_mm_srli_si128(b, 8)), s);
  }
  static constexpr int64_t bytes = kGroup;
};

// kRows rows of y starting at m0, output columns [n0, n1). The row count is a template argument so the
// accumulators stay in registers; the per-row arithmetic is the same for every kRows.
template <typename G, int kRows>
void tile(const float* x, int64_t ldx, const uint8_t* q, const float* scale, const float* mins,
          float* y, int64_t ldy, int64_t m0, int64_t n0, int64_t n1, int64_t K) {
  const int64_t groups = K / kGroup;
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = q + n * groups * G::bytes;
    const float* sn = scale + n * groups;
    const float* mn = mins != nullptr ? mins + n * groups : nullptr;
    __m256 acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = zero;
    for (int64_t g = 0; g < groups; ++g) {
      __m256 w[4];
      G::load(qn + g * G::bytes, _mm256_set1_ps(sn[g]), mn != nullptr ? _mm256_set1_ps(mn[g]) : zero, w);
      for (int r = 0; r < kRows; ++r) {
        const float* xr = x + (m0 + r) * ldx + g * kGroup;
        __m256 d = _mm256_mul_ps(_mm256_loadu_ps(xr), w[0]);
        d = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w[1], d);
        d = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w[2], d);
        d = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w[3], d);
        acc[r] = _mm256_add_ps(acc[r], d);
      }
    }
    for (int r = 0; r < kRows; ++r) y[(m0 + r) * ldy + n] = hsum(acc[r]);
  }
}

template <typename G>
void rows_tile(int rows, const float* x, int64_t ldx, const uint8_t* q, const float* scale, const float* mins,
               float* y, int64_t ldy, int64_t m0, int64_t n0, int64_t n1, int64_t K) {
  switch (rows) {
    case 1: return tile<G, 1>(x, ldx, q, scale, mins, y, ldy, m0, n0, n1, K);
    case 2: return tile<G, 2>(x, ldx, q, scale, mins, y, ldy, m0, n0, n1, K);
    case 3: return tile<G, 3>(x, ldx, q, scale, mins, y, ldy, m0, n0, n1, K);
    case 4: return tile<G, 4>(x, ldx, q, scale, mins, y, ldy, m0, n0, n1, K);
    case 5: return tile<G, 5>(x, ldx, q, scale, mins, y, ldy, m0, n0, n1, K);
    case 6: return tile<G, 6>(x, ldx, q, scale, mins, y, ldy, m0, n0, n1, K);
    case 7: return tile<G, 7>(x, ldx, q, scale, mins, y, ldy, m0, n0, n1, K);
    default: return tile<G, 8>(x, ldx, q, scale, mins, y, ldy, m0, n0, n1, K);
  }
}

template <typename G>
at::Tensor matmul(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale,
                  const c10::optional<at::Tensor>& mins) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % kGroup == 0, "x must be [M, K] with K a multiple of 32");
  TORCH_CHECK(q.is_contiguous() && scale.is_contiguous() && scale.scalar_type() == at::kFloat,
              "packed weight and fp32 scales must be contiguous");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0), groups = K / kGroup;
  TORCH_CHECK(scale.size(1) == groups && q.size(0) == N && q.numel() == N * groups * G::bytes,
              "weight shape does not match x");
  const float* mp = nullptr;
  if (mins.has_value()) {
    TORCH_CHECK(mins->sizes() == scale.sizes() && mins->is_contiguous() && mins->scalar_type() == at::kFloat,
                "mins must be fp32 and shaped like scales");
    mp = mins->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Grain: 16 output columns, so a decode-sized matmul still spreads over every thread. Row tiles run
  // inside a thread's columns, so their weights are read from memory once and from cache after.
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowTile, M - m0));
      rows_tile<G>(rows, xp, K, qp, sp, mp, yp, N, m0, n0, n1, K);
    }
  });
  return y.to(x_in.scalar_type());
}

at::Tensor q4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& mins) {
  return matmul<Q4Group>(x, packed, scale, mins);
}

at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  return matmul<Q8Group>(x, codes, scale, c10::nullopt);
}

// ---------------------------------------------------------------------------------------------------------
// Paged attention over a flat batch (model/attention.py's metadata): new token i of request r sits at
// position seq_lens[r] - q_len + i and attends keys 0 .. that position, read in place from the paged cache
// [2, num_blocks, block_size, Hkv, D] through the request's block table (no gather). One work item is one
// (token, KV head): its K and V rows are read once for the heads that share them (GQA). Scores, softmax
// (max-subtracted, two passes) and the weighted V sum are fp32, in key order: a row's result depends only on
// its own keys, never on the batch, the chunking or the thread count.

inline float load_f(const float* p) { return *p; }
inline float load_f(const at::BFloat16* p) { return static_cast<float>(*p); }

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 -> fp32: the 16 bits become the high half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <typename KV>
void attend_item(const float* q, const KV* k_cache, const KV* v_cache, const int32_t* table, int64_t pos,
                 int64_t kvh, int per_kv, int64_t D, int64_t H_kv, int64_t block_size, float scale, float* out,
                 std::vector<float>& scores) {
  const int64_t n = pos + 1;
  scores.resize(static_cast<size_t>(per_kv * n));
  std::vector<float> mx(per_kv, -INFINITY);
  for (int64_t p = 0; p < n; ++p) {
    const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
    const KV* krow = k_cache + (slot * H_kv + kvh) * D;
    for (int h = 0; h < per_kv; ++h) {
      const float* qh = q + h * D;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8(krow + d), acc);
      const float sc = hsum(acc) * scale;
      scores[h * n + p] = sc;
      mx[h] = std::max(mx[h], sc);
    }
  }
  for (int h = 0; h < per_kv; ++h) {
    float* sh = scores.data() + h * n;
    float sum = 0.f;
    for (int64_t p = 0; p < n; ++p) {
      sh[p] = std::exp(sh[p] - mx[h]);
      sum += sh[p];
    }
    const float inv = 1.f / sum;
    for (int64_t p = 0; p < n; ++p) sh[p] *= inv;
    std::fill(out + h * D, out + (h + 1) * D, 0.f);
  }
  for (int64_t p = 0; p < n; ++p) {
    const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
    const KV* vrow = v_cache + (slot * H_kv + kvh) * D;
    for (int h = 0; h < per_kv; ++h) {
      const __m256 w = _mm256_set1_ps(scores[h * n + p]);
      float* oh = out + h * D;
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(oh + d, _mm256_fmadd_ps(w, load8(vrow + d), _mm256_loadu_ps(oh + d)));
    }
  }
}

template <typename KV>
void attention_impl(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                    const at::Tensor& qsl, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = kv.size(2), H_kv = kv.size(3), R = seq_lens.size(0);
  const int per_kv = static_cast<int>(H / H_kv);
  const KV* k_cache = kv.data_ptr<KV>();
  const KV* v_cache = k_cache + kv.stride(0);
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* qs = qsl.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  std::vector<int64_t> req_of(T), pos_of(T);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t q_len = qs[r + 1] - qs[r];
    for (int64_t i = 0; i < q_len; ++i) {
      req_of[qs[r] + i] = r;
      pos_of[qs[r] + i] = sl[r] - q_len + i;
    }
  }
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ld_table = tables.size(1);
  at::parallel_for(0, T * H_kv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H_kv, kvh = i % H_kv;
      attend_item<KV>(qp + (t * H + kvh * per_kv) * D, k_cache, v_cache, tp + req_of[t] * ld_table, pos_of[t],
                      kvh, per_kv, D, H_kv, block_size, static_cast<float>(scale), op + (t * H + kvh * per_kv) * D,
                      scores);
    }
  });
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && kv_cache.is_contiguous(), "bad attention shapes");
  TORCH_CHECK(query.size(2) % 8 == 0 && query.size(2) == kv_cache.size(4), "head_dim must be a multiple of 8");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
              seq_lens.scalar_type() == at::kInt, "metadata must be int32");
  const at::Tensor q = query.to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(q);
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor qsl = query_start_loc.contiguous(), sl = seq_lens.contiguous();
  if (kv_cache.scalar_type() == at::kFloat) {
    attention_impl<float>(q, kv_cache, tables, qsl, sl, scale, out);
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16, "KV cache must be float32 or bfloat16");
    attention_impl<at::BFloat16>(q, kv_cache, tables, qsl, sl, scale, out);
  }
  return out.to(query.scalar_type());
}

// ---------------------------------------------------------------------------------------------------------
// Fused small ops of a decoder layer (fp32), each a row-by-row loop: (residual add +) RMSNorm, and rotary
// embedding of q and k with the K/V write into the paged cache.

// y = x / sqrt(mean(x^2) + eps) * w for each row of x [T, Hd]; with delta: h += delta first (in place).
void add_rms_norm_rows(float* h, const float* delta, const float* w, float* y, int64_t T, int64_t Hd, double eps) {
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* hr = h + t * Hd;
      if (delta != nullptr) {
        const float* dr = delta + t * Hd;
        for (int64_t i = 0; i < Hd; ++i) hr[i] += dr[i];
      }
      double ss = 0.0;
      for (int64_t i = 0; i < Hd; ++i) ss += static_cast<double>(hr[i]) * hr[i];
      const float inv = static_cast<float>(1.0 / std::sqrt(ss / Hd + eps));
      float* yr = y + t * Hd;
      for (int64_t i = 0; i < Hd; ++i) yr[i] = w[i] * (hr[i] * inv);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: fp32 only");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t Hd = xc.size(-1);
  add_rms_norm_rows(xc.data_ptr<float>(), nullptr, weight.contiguous().data_ptr<float>(), y.data_ptr<float>(),
                    xc.numel() / Hd, Hd, eps);
  return y;
}

// h + delta -> (the new residual, its RMSNorm); h is not modified (a new tensor is returned).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(h.scalar_type() == at::kFloat && delta.scalar_type() == at::kFloat, "add_rms_norm: fp32 only");
  TORCH_CHECK(h.sizes() == delta.sizes(), "add_rms_norm: shapes differ");
  at::Tensor out = h.contiguous().clone();
  at::Tensor y = at::empty_like(out);
  const int64_t Hd = out.size(-1);
  add_rms_norm_rows(out.data_ptr<float>(), delta.contiguous().data_ptr<float>(),
                    weight.contiguous().data_ptr<float>(), y.data_ptr<float>(), out.numel() / Hd, Hd, eps);
  return {out, y};
}

// qkv [T, (H + 2 Hkv) D] -> q [T, H, D] with rotary embedding (rotate-half layout, cos/sin tables [P, D]);
// k (rotated) and v are written to kv_cache [2, blocks, block_size, Hkv, D] at slot_mapping[t].
at::Tensor rope_write_kv(const at::Tensor& qkv_in, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor kv_cache, const at::Tensor& slot_mapping,
                         int64_t H, int64_t Hkv) {
  TORCH_CHECK(qkv_in.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat &&
              cos.scalar_type() == at::kFloat, "rope_write_kv: fp32 only");
  TORCH_CHECK(kv_cache.is_contiguous() && positions.scalar_type() == at::kLong &&
              slot_mapping.scalar_type() == at::kLong, "rope_write_kv: bad cache or index dtypes");
  const at::Tensor qkv = qkv_in.contiguous(), pos = positions.contiguous(), slots = slot_mapping.contiguous();
  const int64_t T = qkv.size(0), D = kv_cache.size(4), half = D / 2, width = qkv.size(1);
  TORCH_CHECK(width == (H + 2 * Hkv) * D && kv_cache.size(3) == Hkv, "rope_write_kv: shapes do not match");
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.contiguous().data_ptr<float>();
  const float* sp = sin.contiguous().data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* slp = slots.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  float* kc = kv_cache.data_ptr<float>();
  float* vc = kc + kv_cache.stride(0);
  auto rotate = [&](const float* x, const float* c, const float* s, float* out) {
    for (int64_t i = 0; i < half; ++i) {
      out[i] = x[i] * c[i] - x[i + half] * s[i];
      out[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
    }
  };
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = src + t * width;
      const float* c = cp + pp[t] * D;
      const float* s = sp + pp[t] * D;
      for (int64_t h = 0; h < H; ++h) rotate(row + h * D, c, s, qp + (t * H + h) * D);
      float* kdst = kc + slp[t] * Hkv * D;
      float* vdst = vc + slp[t] * Hkv * D;
      for (int64_t h = 0; h < Hkv; ++h) rotate(row + (H + h) * D, c, s, kdst + h * D);
      std::copy(row + (H + Hkv) * D, row + (H + 2 * Hkv) * D, vdst);
    }
  });
  return q;
}

}  // namespace

TORCH_LIBRARY(specserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor h, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_write_kv(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) kv_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads) -> Tensor");
  m.def("q4_mm(Tensor x, Tensor packed, Tensor scale, Tensor mins) -> Tensor");
  m.def("q8_mm(Tensor x, Tensor codes, Tensor scale) -> Tensor");
  m.def("paged_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) {
  m.impl("q4_mm", q4_mm);
  m.impl("q8_mm", q8_mm);
  m.impl("paged_attention", paged_attention);
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rope_write_kv", rope_write_kv);
}
