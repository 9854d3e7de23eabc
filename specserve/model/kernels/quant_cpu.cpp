// Weight-only quantized matmuls for x86 CPUs (AVX2 + FMA), registered as torch ops specserve_cpu::*.
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

}  // namespace

TORCH_LIBRARY(specserve_cpu, m) {
  m.def("q4_mm(Tensor x, Tensor packed, Tensor scale, Tensor mins) -> Tensor");
  m.def("q8_mm(Tensor x, Tensor codes, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) {
  m.impl("q4_mm", q4_mm);
  m.impl("q8_mm", q8_mm);
}
