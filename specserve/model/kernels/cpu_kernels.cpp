// CPU kernels for x86 (AVX2 + FMA), registered as torch ops specserve_cpu::*: weight-only quantized
// matmuls, paged attention, and the fused small ops of a decoder layer.
//
// y[M, N] = x[M, K] @ w.T with w stored in groups of 32 along K, as llama.cpp's Q4_1 / Q8_0 store them:
//   q4: packed [N, K / 2] uint8; in group g of row n, byte i holds code i (low nibble) and code i + 16
//       (high nibble); w = scale[n, g] * code + min[n, g], code in 0..15.
//   q8: codes [N, K] int8; w = scale[n, g] * code.
// Per group, the activations are rounded to a 16-bit grid of their own (round(x / d), d = max|x| / 32767),
// multiplied with the weight codes exactly in integers (vpmaddwd), and the group's sum is scaled by
// scale * d in fp32 (the 4-bit min term uses the exact fp32 sum of x). Relative to fp32 activations this adds
// at most 1/65534 of a group's largest activation per element; it halves the instructions per weight, which
// decide the speed here (measured on AVX2 without 512-bit units: 2.1x at one row).
//
// NOTE: each output y[m, n] is summed by one thread in an order that depends only on K -- never on M, on
// the other rows, or on the thread count -- and each row's activations are rounded on their own, so the
// result of a row is the same in any batch (decode at 1 row and verification at k + 1 rows agree bit for
// bit). The weight codes of a group are widened once and applied to up to kRowTile rows, so a k + 1-row
// verification reads the weights once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <optional>
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

// Activation rows in groups of 32: codes round(x / d) with d = max|x| / 32767 (a 16-bit grid: the largest
// rounding error is 1/65534 of the group's largest value), and the group's fp32 sum (for the min term).
struct Rows {
  std::vector<int16_t> q;  // [M, K]
  std::vector<float> d;    // [M, groups]
  std::vector<float> sum;  // [M, groups]
};
Rows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t G = K / kGroup;
  Rows o{std::vector<int16_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G)};
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t i = 0; i < M * G; ++i) {
    const float* xg = x + i * kGroup;
    __m256 v[4], mx = _mm256_setzero_ps(), sm = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) { v[j] = _mm256_loadu_ps(xg + 8 * j); mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j])); sm = _mm256_add_ps(sm, v[j]); }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4)); m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
    __m256i c[4];
    for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
    // packs per 128-bit lane: [c0 0-3, c1 0-3 | c0 4-7, c1 4-7] -> permute 64-bit quarters into order
    const __m256i a = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
    const __m256i b = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.q.data() + i * kGroup), a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.q.data() + i * kGroup + 16), b);
    o.d[i] = amax / 32767.f;
    o.sum[i] = hsum(sm);
  }
  return o;
}
// kRows rows of y from m0, output columns [n0, n1): per group, 16-bit x codes times the weight codes in
// integers (vpmaddwd: exact), scaled by scale * d in fp32; the row count is a template argument so the
// accumulators stay in registers, and the arithmetic of a row is the same for every row count.
template <bool kQ4, int R>
void tile(const Rows& xq, int64_t K, const uint8_t* q, const float* sc, const float* mins, float* y, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t G = K / kGroup, bytes = kQ4 ? 16 : 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = q + n * G * bytes; const float* sn = sc + n * G;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256i w0, w1;  // codes 0-15 and 16-31 as i16
      if constexpr (kQ4) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + g * 16));
        const __m128i m = _mm_set1_epi8(0x0F);
        w0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, m));
        w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m));
      } else {
        w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + g * 32)));
        w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + g * 32 + 16)));
      }
      const __m256 ws = _mm256_broadcast_ss(sn + g);
      for (int r = 0; r < R; ++r) {
        const int64_t row = (m0 + r) * G + g;
        const int16_t* xr = xq.q.data() + row * kGroup;
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr))),
                                           _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 16))));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(ws, _mm256_broadcast_ss(xq.d.data() + row)), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float m = 0.f;
      if constexpr (kQ4) {  // the min term: sum over groups of min * sum(x), 8 groups at a time
        const float* mn = mins + n * G; const float* xs = xq.sum.data() + (m0 + r) * G;
        __m256 mv = _mm256_setzero_ps(); int64_t g = 0;
        for (; g + 8 <= G; g += 8) mv = _mm256_fmadd_ps(_mm256_loadu_ps(mn + g), _mm256_loadu_ps(xs + g), mv);
        m = hsum(mv);
        for (; g < G; ++g) m += mn[g] * xs[g];
      }
      y[(m0 + r) * N + n] = hsum(acc[r]) + m;
    }
  }
}
template <bool kQ4>
at::Tensor mm(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& sc, const c10::optional<at::Tensor>& mins) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % kGroup == 0, "x must be [M, K] with K a multiple of 32");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = sc.size(0);
  TORCH_CHECK(sc.is_contiguous() && sc.scalar_type() == at::kFloat && sc.size(1) == K / kGroup && q.is_contiguous() &&
              q.numel() == N * K / (kQ4 ? 2 : 1), "weight shape does not match x");
  TORCH_CHECK(!kQ4 || (mins.has_value() && mins->sizes() == sc.sizes() && mins->is_contiguous()), "bad mins");
  const Rows xq = quantize_rows(x.data_ptr<float>(), M, K);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr()); const float* sp = sc.data_ptr<float>();
  const float* mp = mins.has_value() ? mins->data_ptr<float>() : nullptr; float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
      switch (std::min<int64_t>(kRowTile, M - m0)) {
        case 1: tile<kQ4,1>(xq,K,qp,sp,mp,yp,N,m0,n0,n1); break;
        case 2: tile<kQ4,2>(xq,K,qp,sp,mp,yp,N,m0,n0,n1); break;
        case 3: tile<kQ4,3>(xq,K,qp,sp,mp,yp,N,m0,n0,n1); break;
        case 4: tile<kQ4,4>(xq,K,qp,sp,mp,yp,N,m0,n0,n1); break;
        case 5: tile<kQ4,5>(xq,K,qp,sp,mp,yp,N,m0,n0,n1); break;
        case 6: tile<kQ4,6>(xq,K,qp,sp,mp,yp,N,m0,n0,n1); break;
        case 7: tile<kQ4,7>(xq,K,qp,sp,mp,yp,N,m0,n0,n1); break;
        default: tile<kQ4,8>(xq,K,qp,sp,mp,yp,N,m0,n0,n1); break;
      }
    }
  });
  return y.to(x_in.scalar_type());
}
at::Tensor q4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& mins) {
  return mm<true>(x, packed, scale, mins);
}

at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  return mm<false>(x, codes, scale, c10::nullopt);
}

// ---------------------------------------------------------------------------------------------------------
// Paged attention over a flat batch (model/attention.py's metadata): new token i of request r sits at
// position seq_lens[r] - q_len + i and attends keys 0 .. that position (with a sliding window w > 0: keys
// max(0, position - w + 1) .. position), read in place from the paged cache
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

// exp(x) for 8 floats (Cephes-style: x = n ln2 + r, |r| <= ln2 / 2, degree-6 polynomial for e^r, 2^n
// through the exponent bits); relative error about 2e-7, exp(-inf) = 0. Softmax arguments are <= 0.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// One (token, KV head): the token at position pos over keys first .. pos; with key_pos (a tree token), key i
// is the one at chain position key_pos[i] instead of first + i.
template <typename KV>
void attend_item(const float* q, const KV* k_cache, const KV* v_cache, const int32_t* table, int64_t first,
                 int64_t pos, int64_t kvh, int per_kv, int64_t D, int64_t H_kv, int64_t block_size, float scale,
                 float* out, std::vector<float>& scores, const int64_t* key_pos = nullptr) {
  const int64_t n = pos + 1 - first, stride = (n + 7) / 8 * 8;
  scores.assign(static_cast<size_t>(per_kv * stride), -INFINITY);
  std::vector<const KV*> rows(static_cast<size_t>(n));  // key first + i's K row (V row: the same offset)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = key_pos != nullptr ? key_pos[i] : first + i;
    const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
    rows[i] = k_cache + (slot * H_kv + kvh) * D;
  }
  const __m256 vscale = _mm256_set1_ps(scale);
  const int64_t full = n / 8 * 8;
  for (int h = 0; h < per_kv; ++h) {
    const float* qh = q + h * D;
    for (int64_t p = 0; p < full; p += 8) {  // 8 keys at once, reduced together (one hadd tree)
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qh + d);
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, load8(rows[p + j] + d), a[j]);
      }
      const __m256 h4 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      const __m256 h5 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
      const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h4, h5, 0x20), _mm256_permute2f128_ps(h4, h5, 0x31));
      _mm256_storeu_ps(scores.data() + h * stride + p, _mm256_mul_ps(sums, vscale));
    }
    for (int64_t p = full; p < n; ++p) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8(rows[p] + d), acc);
      scores[h * stride + p] = hsum(acc) * scale;
    }
  }
  const int64_t v_off = v_cache - k_cache;
  for (int h = 0; h < per_kv; ++h) {
    float* sh = scores.data() + h * stride;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t p = 0; p < stride; p += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sh + p));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(m4));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t p = 0; p < stride; p += 8) {  // padding holds -inf: exp gives 0
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + p), m));
      _mm256_storeu_ps(sh + p, e);
      sum = _mm256_add_ps(sum, e);
    }
    const float inv = 1.f / hsum(sum);
    // out_h = sum_p e_p V_p / sum, accumulated in registers 64 dims at a time, keys in order
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int64_t width = std::min<int64_t>(64, D - d0);
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t p = 0; p < n; ++p) {
        const __m256 w = _mm256_set1_ps(sh[p]);
        const KV* vrow = rows[p] + v_off + d0;
        for (int j = 0; j < width / 8; ++j) acc[j] = _mm256_fmadd_ps(w, load8(vrow + 8 * j), acc[j]);
      }
      const __m256 iv = _mm256_set1_ps(inv);
      for (int j = 0; j < width / 8; ++j) _mm256_storeu_ps(out + h * D + d0 + 8 * j, _mm256_mul_ps(acc[j], iv));
    }
  }
}

template <typename KV>
void attention_impl(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                    const at::Tensor& qsl, const at::Tensor& seq_lens, double scale, int64_t window,
                    const int64_t* tree_base, const int64_t* tree_mask, at::Tensor& out) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = kv.size(2), H_kv = kv.size(3), R = seq_lens.size(0);
  const int per_kv = static_cast<int>(H / H_kv);
  const KV* k_cache = kv.data_ptr<KV>();
  const KV* v_cache = k_cache + kv.stride(0);
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* qs = qsl.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  std::vector<int64_t> req_of(T), pos_of(T);
  // Tree tokens (model/attention_metadata.py TREE_DOC): their keys' chain positions, context then the mask's.
  std::vector<std::vector<int64_t>> tree_keys(tree_mask != nullptr ? T : 0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t q_len = qs[r + 1] - qs[r];
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t t = qs[r] + i;
      req_of[t] = r;
      pos_of[t] = sl[r] - q_len + i;
      if (tree_mask != nullptr && tree_mask[t] != 0) {
        std::vector<int64_t>& keys = tree_keys[t];
        for (int64_t p = 0; p < tree_base[t]; ++p) keys.push_back(p);
        for (int64_t j = 0; j < 63; ++j)
          if ((tree_mask[t] >> j) & 1) keys.push_back(tree_base[t] + j);
        pos_of[t] = static_cast<int64_t>(keys.size()) - 1;
      }
    }
  }
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ld_table = tables.size(1);
  at::parallel_for(0, T * H_kv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H_kv, kvh = i % H_kv;
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos_of[t] - window + 1) : 0;
      const int64_t* key_pos = tree_keys.empty() || tree_keys[t].empty() ? nullptr : tree_keys[t].data() + first;
      attend_item<KV>(qp + (t * H + kvh * per_kv) * D, k_cache, v_cache, tp + req_of[t] * ld_table, first,
                      pos_of[t], kvh, per_kv, D, H_kv, block_size, static_cast<float>(scale),
                      op + (t * H + kvh * per_kv) * D, scores, key_pos);
    }
  });
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                           int64_t window, const std::optional<at::Tensor>& tree_base = std::nullopt,
                           const std::optional<at::Tensor>& tree_mask = std::nullopt) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && kv_cache.is_contiguous(), "bad attention shapes");
  TORCH_CHECK(query.size(2) % 8 == 0 && query.size(2) == kv_cache.size(4), "head_dim must be a multiple of 8");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
              seq_lens.scalar_type() == at::kInt, "metadata must be int32");
  const at::Tensor q = query.to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(q);
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor qsl = query_start_loc.contiguous(), sl = seq_lens.contiguous();
  at::Tensor tb, tm;
  const int64_t* tbp = nullptr;
  const int64_t* tmp = nullptr;
  if (tree_mask.has_value() && tree_base.has_value()) {
    tb = tree_base->contiguous();
    tm = tree_mask->contiguous();
    TORCH_CHECK(tb.scalar_type() == at::kLong && tm.scalar_type() == at::kLong && tm.numel() == q.size(0) &&
                tb.numel() == q.size(0), "tree_base / tree_mask must be int64 [num_tokens]");
    tbp = tb.data_ptr<int64_t>();
    tmp = tm.data_ptr<int64_t>();
  }
  if (kv_cache.scalar_type() == at::kFloat) {
    attention_impl<float>(q, kv_cache, tables, qsl, sl, scale, window, tbp, tmp, out);
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16, "KV cache must be float32 or bfloat16");
    attention_impl<at::BFloat16>(q, kv_cache, tables, qsl, sl, scale, window, tbp, tmp, out);
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

// ---------------------------------------------------------------------------------------------------------
// One whole decoder layer (Llama-style: pre-norm attention and gated SiLU MLP) in one call, so a decode step
// costs one dispatch per layer instead of about fifteen. It calls exactly the functions the per-op path
// calls, in the same order, so its result is bit-for-bit that path's. A matmul weight is (codes, scale, mins):
// 4-bit when mins is given, 8-bit codes otherwise.
at::Tensor qmm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
               const c10::optional<at::Tensor>& mins) {
  return mins.has_value() ? mm<true>(x, codes, scale, mins) : mm<false>(x, codes, scale, c10::nullopt);
}

// (h + delta, the layer's output delta); h + delta is the residual stream after the previous layer (delta
// None: h itself, the first layer). Neither h nor delta is modified.
std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& h, const c10::optional<at::Tensor>& delta, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& qkv_codes, const at::Tensor& qkv_scale,
    const c10::optional<at::Tensor>& qkv_mins, const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o_codes,
    const at::Tensor& o_scale, const c10::optional<at::Tensor>& o_mins, const at::Tensor& gate_up_codes,
    const at::Tensor& gate_up_scale, const c10::optional<at::Tensor>& gate_up_mins, const at::Tensor& down_codes,
    const at::Tensor& down_scale, const c10::optional<at::Tensor>& down_mins, const at::Tensor& positions,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor kv_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t H,
    int64_t Hkv, double scale, int64_t window) {
  at::Tensor res, x;
  if (delta.has_value()) {
    std::tie(res, x) = add_rms_norm(h, *delta, input_norm, eps);
  } else {
    res = h.contiguous().clone();
    x = rms_norm(res, input_norm, eps);
  }
  at::Tensor qkv = qmm(x, qkv_codes, qkv_scale, qkv_mins);
  if (qkv_bias.has_value()) qkv = qkv + *qkv_bias;
  const at::Tensor q = rope_write_kv(qkv, positions, cos, sin, kv_cache, slot_mapping, H, Hkv);
  const at::Tensor a = paged_attention(q, kv_cache, block_tables, query_start_loc, seq_lens, scale, window);
  const at::Tensor o = qmm(a.reshape({a.size(0), -1}), o_codes, o_scale, o_mins);
  const int64_t Hd = res.size(-1);  // res += o, x = norm(res): in place (res is this call's own tensor)
  add_rms_norm_rows(res.data_ptr<float>(), o.data_ptr<float>(), post_norm.contiguous().data_ptr<float>(),
                    x.data_ptr<float>(), res.numel() / Hd, Hd, eps);
  const at::Tensor gu = qmm(x, gate_up_codes, gate_up_scale, gate_up_mins);
  const int64_t inter = gu.size(1) / 2;
  const at::Tensor act = at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter);
  return {res, qmm(act, down_codes, down_scale, down_mins)};
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
        "Tensor seq_lens, float scale, int window, Tensor? tree_base=None, Tensor? tree_mask=None) -> Tensor");
  m.def("decoder_layer(Tensor h, Tensor? delta, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor qkv_codes, Tensor qkv_scale, Tensor? qkv_mins, Tensor? qkv_bias, Tensor o_codes, Tensor o_scale, "
        "Tensor? o_mins, Tensor gate_up_codes, Tensor gate_up_scale, Tensor? gate_up_mins, Tensor down_codes, "
        "Tensor down_scale, Tensor? down_mins, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) kv_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, int num_heads, "
        "int num_kv_heads, float scale, int window) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) {
  m.impl("q4_mm", q4_mm);
  m.impl("q8_mm", q8_mm);
  m.impl("paged_attention", paged_attention);
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rope_write_kv", rope_write_kv);
  m.impl("decoder_layer", decoder_layer);
}
