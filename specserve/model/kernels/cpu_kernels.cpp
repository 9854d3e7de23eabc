// CPU kernels for x86 (AVX2 + FMA; the tiled matmuls below also AVX-512 VNNI, compiled for it and called only
// where the CPU has it), registered as torch ops specserve_cpu::*: weight-only quantized matmuls, paged
// attention, and the fused small ops of a decoder layer.
//
// The row layout (any AVX2 CPU); the tiled layout is described at its kernels.
// y[M, N] = x[M, K] @ w.T with w stored in groups of 32 along K, as llama.cpp's Q4_1 / Q8_0 store them:
//   q4: packed [N, K / 2] uint8; in group g of row n, byte i holds code i (low nibble) and code i + 16
//       (high nibble); w = scale[n, g] * code + min[n, g], code in 0..15.
//   q8: codes [N, K] int8; w = scale[n, g] * code.
// Per group, the activations are rounded to a 16-bit grid of their own (round(x / d), d = max|x| / 32767; with
// act_bits 8, d = max|x| / 127: the tiled layout's 8-bit numbers, computed in the same 16-bit lanes),
// multiplied with the weight codes exactly in integers (vpmaddwd), and the group's sum is scaled by
// scale * d in fp32 (the 4-bit min term uses the exact fp32 sum of x). Relative to fp32 activations this adds
// at most 1/65534 of a group's largest activation per element; it halves the instructions per weight, which
// decide the speed here (measured on AVX2 without 512-bit units: 2.1x at one row). The inner loop takes two
// groups at a time, one per 128-bit lane, so the conversion and scaling of the integer sums cost one
// instruction each per two groups.
//
// NOTE: each output y[m, n] is summed by one thread in an order that depends only on K -- never on M, on
// the other rows, or on the thread count -- and each row's activations are rounded on their own, so the
// result of a row is the same in any batch (decode at 1 row and verification at k + 1 rows agree bit for
// bit). The weight codes of a block are widened once and applied to up to kRowTile rows, so a k + 1-row
// verification reads the weights once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int kGroup = 32;
constexpr int kRowTile = 6;  // rows per pass over the weights (more spill the accumulators out of registers)

// f(std::integral_constant<int, r>{}) for a runtime 1 <= r <= Max: the kernels take their row count as a
// template argument so the accumulators stay in registers.
template <int Max, int R = 1, typename F>
inline void with_rows(int64_t r, F&& f) {
  if constexpr (R >= Max) f(std::integral_constant<int, Max>{});
  else if (r == R) f(std::integral_constant<int, R>{});
  else with_rows<Max, R + 1>(r, f);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Activation rows for the matmuls, in pairs of groups ("blocks", the unit of the kernel's inner loop).
// Each group of 32 is rounded to a 16-bit grid of its own: codes round(x / d), d = max|x| / 32767 (the
// largest rounding error is 1/65534 of the group's largest value). A block of groups a, b holds its 64 codes
// in the order the unpacked weight registers have them: [a0-7, b0-7, a8-15, b8-15, a16-23, b16-23, a24-31,
// b24-31]; with an odd group count the last group a is a block of its own: [a0-7, a16-23, a8-15, a24-31].
// dv: per block the 8 fp32 lanes' activation scales, [da x4, db x4] (a lone group: da x8); sum: per group
// the fp32 sum of x (the 4-bit min term).
struct Rows {
  int64_t G, B;            // groups and blocks per row
  std::vector<int16_t> q;  // [M, B * 64]
  std::vector<float> dv;   // [M, B, 8]
  std::vector<float> sum;  // [M, G]
};
Rows quantize_rows(const float* x, int64_t M, int64_t K, float levels) {
  const int64_t G = K / kGroup, B = (G + 1) / 2;
  Rows o{G, B, std::vector<int16_t>(M * B * 64), std::vector<float>(M * B * 8), std::vector<float>(M * G)};
  const __m256 sign = _mm256_set1_ps(-0.f);
  static constexpr int kLone[4] = {0, 2, 1, 3};  // a lone group's 8-code chunks: slots in its block
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + m * K + g * kGroup;
      __m256 v[4], mx = _mm256_setzero_ps(), sm = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) { v[j] = _mm256_loadu_ps(xg + 8 * j); mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j])); sm = _mm256_add_ps(sm, v[j]); }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4)); m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4), d = amax / levels;
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? levels / amax : 0.f);
      __m256i c[4];
      for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
      // packs per 128-bit lane: [c0 0-3, c1 0-3 | c0 4-7, c1 4-7] -> permute 64-bit quarters into order
      const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);  // codes 0-15
      const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8);  // codes 16-31
      const __m128i chunk[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                                _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
      const int64_t b = g / 2;
      const bool lone = g == G - 1 && G % 2;
      int16_t* dst = o.q.data() + (m * B + b) * 64;
      float* dv = o.dv.data() + (m * B + b) * 8;
      for (int j = 0; j < 4; ++j) {
        const int slot = lone ? kLone[j] * 8 : j * 16 + (g % 2) * 8;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + slot), chunk[j]);
      }
      for (int j = 0; j < (lone ? 8 : 4); ++j) dv[(g % 2) * 4 + j] = d;
      o.sum[m * G + g] = hsum(sm);
    }
  }
  return o;
}

// Weight scales and mins are fp32 or fp16 (GGUF keeps them in fp16: half the bytes a decode step streams
// for them); S is the stored type. scale2: the two scales of a block in lanes 0, 1; scale8: eight in order.
template <typename S> inline __m128 scale2(const S* p);
template <> inline __m128 scale2<float>(const float* p) { return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p))); }
template <> inline __m128 scale2<at::Half>(const at::Half* p) {
  int32_t bits; std::memcpy(&bits, p, 4); return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}
template <typename S> inline __m256 scale8(const S* p);
template <> inline __m256 scale8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <> inline __m256 scale8<at::Half>(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// How the row layout's kernels read a weight's per-group scales (or mins):
//   Plain<S>: one fp32 / fp16 value per group, [N, G];
//   Blob<H>: the two-level scales of llama.cpp's K-quants, value = sub * sup: per row and super-block of 8
//     groups (256 weights), 8 H int8 subs (H = 2: one per half group of 16, as Q6_K has them) then the fp16
//     sup; [N, G / 8, 8 H + 2] bytes. An 8-bit integer times an fp16 has at most 19 significant bits, so the
//     fp32 product is exact: the kernels compute with the file's numbers, as with a Plain<float> of products.
//   Plain<S, 2>: one per half group (Q6_K's scales as fp32 products, where a slice lost the super-blocks).
inline __m128 scale4(const float* p) { return _mm_loadu_ps(p); }
inline __m128 scale4(const at::Half* p) { return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
// ``sup(n, g)``: read once per super-block by the kernel and handed back (Plain: nothing).
template <typename S, int H = 1> struct Plain {
  static constexpr int kHalves = H;
  const S* p; int64_t G;
  __m128 sup(int64_t, int64_t) const { return _mm_setzero_ps(); }
  __m128 pair(int64_t n, int64_t g, __m128) const { return scale2<S>(p + n * G + g); }  // groups g, g + 1: lanes 0, 1
  __m128 four(int64_t n, int64_t g, __m128) const { return scale4(p + (n * G + g) * H); }  // H = 2: [g lo, g hi, g+1 lo, g+1 hi]
  float one(int64_t n, int64_t g) const { return static_cast<float>(p[n * G + g]); }
  __m256 eight(int64_t n, int64_t g) const { return scale8<S>(p + n * G + g); }
};
template <int H> struct Blob {
  static constexpr int kHalves = H;
  static constexpr int64_t kBytes = 8 * H + 2;
  const uint8_t* p; int64_t G;
  const uint8_t* sb(int64_t n, int64_t g) const { return p + (n * (G / 8) + g / 8) * kBytes; }
  static float sup(const uint8_t* b) { uint16_t h; std::memcpy(&h, b + 8 * H, 2); return _cvtsh_ss(h); }  // F16C
  __m128 sup(int64_t n, int64_t g) const { return _mm_set1_ps(sup(sb(n, g))); }
  // values (g % 8) H .. + 3 of g's super-block: H = 1, groups g .. g + 3; H = 2, [g lo, g hi, g+1 lo, g+1 hi]
  __m128 four(int64_t n, int64_t g, __m128 up) const {
    int32_t bits; std::memcpy(&bits, sb(n, g) + (g % 8) * H, 4);
    return _mm_mul_ps(_mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(bits))), up);
  }
  __m128 pair(int64_t n, int64_t g, __m128 up) const { return four(n, g, up); }
  float one(int64_t n, int64_t g) const {
    const uint8_t* b = sb(n, g);
    return static_cast<float>(static_cast<int8_t>(b[(g % 8) * H])) * sup(b);
  }
  __m256 eight(int64_t n, int64_t g) const {  // H = 1, g % 8 = 0
    const uint8_t* b = sb(n, g);
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
    return _mm256_mul_ps(v, _mm256_set1_ps(sup(b)));
  }
};

// A block's weight codes as four 16-bit registers in the activations' order (above): u[0..3] pair with
// activation registers 0..3; a lone group fills u[0], u[1] only.
//   q4 (one 32-byte load = groups a, b; low nibbles are codes 0-15, high nibbles 16-31), widened in-lane with
//   unpack (lane 0 = group a, lane 1 = group b);
//   q8 (groups a, b are 32 bytes each): [a0-15 | b0-15] and [a16-31 | b16-31], sign-extended in-lane;
//   narrow (``kNarrow`` 5 or 6: 8-bit codes kept in 5 or 6 bits, Q5_0's and Q6_K's): the low 4 bits as q4's
//   nibbles, the high bits from ``qh`` (6 bits: 8 bytes a group, bits 2 s, 2 s + 1 of byte j are code
//   j + 8 s's; 5 bits: 4 bytes a group, bit c % 8 of byte c / 8 is code c's), then - 2^(bits - 1), on as q8.
template <bool kQ4, bool lone, int kNarrow = 0>
inline void block_codes(const uint8_t* qn, int64_t b, __m256i u[4], const uint8_t* qh = nullptr) {
  const __m256i z = _mm256_setzero_si256();
  __m256i r0, r1;  // bytes: [a0-15 | b0-15], [a16-31 | b16-31] (lone: [a0-15 | a16-31] in r0)
  if constexpr (kNarrow != 0) {
    const __m256i m = _mm256_set1_epi8(0x0F), bias = _mm256_set1_epi8(kNarrow == 6 ? 32 : 16);
    __m256i h0, h1 = z;  // each code's high bits at bits 4 (, 5) of its byte, in r0's / r1's order
    if constexpr (kNarrow == 6) {
      const __m256i m2 = _mm256_set1_epi8(0x03);
      if constexpr (lone) {
        int64_t ha; std::memcpy(&ha, qh + b * 16, 8);
        h0 = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(ha), _mm256_setr_epi64x(0, 2, 4, 6)), m2);
      } else {
        const __m256i hh = _mm256_permute4x64_epi64(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + b * 16))), 0x50);  // [Ha Ha Hb Hb]
        h0 = _mm256_and_si256(_mm256_srlv_epi64(hh, _mm256_setr_epi64x(0, 2, 0, 2)), m2);
        h1 = _mm256_and_si256(_mm256_srlv_epi64(hh, _mm256_setr_epi64x(4, 6, 4, 6)), m2);
      }
      h0 = _mm256_slli_epi16(h0, 4);
      h1 = _mm256_slli_epi16(h1, 4);
    } else {  // one bit a code: byte i of a lane takes the byte holding its bit, then tests that bit
      const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL), top = _mm256_set1_epi8(0x10);
      auto expand = [&](__m256i v, __m256i pick) {
        const __m256i t = _mm256_and_si256(_mm256_shuffle_epi8(v, pick), bit);
        return _mm256_and_si256(_mm256_cmpeq_epi8(t, bit), top);
      };
      if constexpr (lone) {
        int32_t wa; std::memcpy(&wa, qh + b * 8, 4);
        h0 = expand(_mm256_set1_epi32(wa), _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                              0x0303030303030303LL));
      } else {
        int64_t w; std::memcpy(&w, qh + b * 8, 8);  // [Wa | Wb]
        const __m256i v = _mm256_set1_epi64x(w);
        h0 = expand(v, _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0404040404040404LL, 0x0505050505050505LL));
        h1 = expand(v, _mm256_setr_epi64x(0x0202020202020202LL, 0x0303030303030303LL, 0x0606060606060606LL,
                                          0x0707070707070707LL));
      }
    }
    if constexpr (lone) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + b * 32));
      r0 = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1), m);
      r0 = _mm256_sub_epi8(_mm256_or_si256(r0, h0), bias);
    } else {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qn + b * 32));
      r0 = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(raw, m), h0), bias);
      r1 = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m), h1), bias);
    }
    const __m256i s0 = _mm256_cmpgt_epi8(z, r0);
    u[0] = _mm256_unpacklo_epi8(r0, s0); u[1] = _mm256_unpackhi_epi8(r0, s0);
    if constexpr (!lone) {
      const __m256i s1 = _mm256_cmpgt_epi8(z, r1);
      u[2] = _mm256_unpacklo_epi8(r1, s1); u[3] = _mm256_unpackhi_epi8(r1, s1);
    }
  } else if constexpr (kQ4) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    if constexpr (lone) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qn + b * 32));
      r0 = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1), m);
    } else {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qn + b * 32));
      r0 = _mm256_and_si256(raw, m);
      r1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m);
    }
    u[0] = _mm256_unpacklo_epi8(r0, z); u[1] = _mm256_unpackhi_epi8(r0, z);
    if constexpr (!lone) { u[2] = _mm256_unpacklo_epi8(r1, z); u[3] = _mm256_unpackhi_epi8(r1, z); }
  } else {
    const uint8_t* p = qn + b * 64;
    if constexpr (lone) {
      r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    } else {
      r0 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32)), 1);
      r1 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))),
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 48)), 1);
    }
    const __m256i s0 = _mm256_cmpgt_epi8(z, r0);
    u[0] = _mm256_unpacklo_epi8(r0, s0); u[1] = _mm256_unpackhi_epi8(r0, s0);
    if constexpr (!lone) {
      const __m256i s1 = _mm256_cmpgt_epi8(z, r1);
      u[2] = _mm256_unpacklo_epi8(r1, s1); u[3] = _mm256_unpackhi_epi8(r1, s1);
    }
  }
}

// R rows of y from m0, output columns [n0, n1). Per block, the 16-bit activation codes times the weight codes
// in integers (vpmaddwd: exact), summed per 128-bit lane (lane 0 = group a, lane 1 = group b), converted
// and scaled by scale * d per lane in fp32. With half-group scales (8-bit codes, Blob<2>) the first and the
// second 16 codes of each group are summed and scaled apart. R is a template argument so the accumulators stay
// in registers; the arithmetic of a row is the same for every R.
template <bool kQ4, typename Sc, int R, int kNarrow = 0>
void tile(const Rows& xq, const uint8_t* q, const Sc& sc, const Sc& mins, float* y, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t G = xq.G, B = xq.B, bytes = kQ4 ? 16 : kNarrow ? 4 * kNarrow : 32;  // narrow: 16 + 4 or 8
  const __m256i pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const int16_t* xb = xq.q.data() + m0 * B * 64; const float* dvb = xq.dv.data() + m0 * B * 8;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = q + n * G * bytes;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    __m128 up = _mm_setzero_ps();  // the super-block's factor (two-level scales), read once per 4 blocks
    auto block = [&](int64_t b, auto lone_t) {
      constexpr bool lone = decltype(lone_t)::value;
      if (b % 4 == 0) up = sc.sup(n, 2 * b);
      __m256i u[4];
      block_codes<kQ4, lone, kNarrow>(qn, b, u, kNarrow ? qn + G * 16 : nullptr);
      if constexpr (Sc::kHalves == 2) {  // lanes of u0 + u1: [a lo | b lo] (lone: [a lo | a hi]); of u2 + u3: [a hi | b hi]
        const __m256 f = _mm256_castps128_ps256(sc.four(n, 2 * b, up));  // [a lo, a hi, b lo, b hi]
        const __m256 wlo = _mm256_permutevar8x32_ps(f, lone ? pair : _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
        const __m256 whi = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));
        for (int r = 0; r < R; ++r) {
          const __m256i* xr = reinterpret_cast<const __m256i*>(xb + (r * B + b) * 64);
          const __m256 dv = _mm256_loadu_ps(dvb + (r * B + b) * 8);
          const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(u[0], _mm256_loadu_si256(xr)), _mm256_madd_epi16(u[1], _mm256_loadu_si256(xr + 1)));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(wlo, dv), acc[r]);
          if constexpr (!lone) {
            const __m256i p2 = _mm256_add_epi32(_mm256_madd_epi16(u[2], _mm256_loadu_si256(xr + 2)), _mm256_madd_epi16(u[3], _mm256_loadu_si256(xr + 3)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p2), _mm256_mul_ps(whi, dv), acc[r]);
          }
        }
        return;
      }
      __m256 ws;
      if constexpr (lone) ws = _mm256_set1_ps(sc.one(n, 2 * b));
      else ws = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(sc.pair(n, 2 * b, up)), pair);
      for (int r = 0; r < R; ++r) {
        const __m256i* xr = reinterpret_cast<const __m256i*>(xb + (r * B + b) * 64);
        __m256i p = _mm256_add_epi32(_mm256_madd_epi16(u[0], _mm256_loadu_si256(xr)), _mm256_madd_epi16(u[1], _mm256_loadu_si256(xr + 1)));
        if constexpr (!lone) p = _mm256_add_epi32(p, _mm256_add_epi32(_mm256_madd_epi16(u[2], _mm256_loadu_si256(xr + 2)), _mm256_madd_epi16(u[3], _mm256_loadu_si256(xr + 3))));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(ws, _mm256_loadu_ps(dvb + (r * B + b) * 8)), acc[r]);
      }
    };
    for (int64_t b = 0; b < G / 2; ++b) block(b, std::false_type{});
    if (G % 2) block(G / 2, std::true_type{});
    for (int r = 0; r < R; ++r) {
      float m = 0.f;
      if constexpr (kQ4) {  // the min term: sum over groups of min * sum(x), 8 groups at a time
        const float* xs = xq.sum.data() + (m0 + r) * G;
        __m256 mv = _mm256_setzero_ps(); int64_t g = 0;
        for (; g + 8 <= G; g += 8) mv = _mm256_fmadd_ps(mins.eight(n, g), _mm256_loadu_ps(xs + g), mv);
        m = hsum(mv);
        for (; g < G; ++g) m += mins.one(n, g) * xs[g];
      }
      y[(m0 + r) * N + n] = hsum(acc[r]) + m;
    }
  }
}
template <bool kQ4, typename Sc, int kNarrow = 0>
void mm_rows(const Rows& xq, const at::Tensor& q, const Sc& sc, const Sc& mins, at::Tensor& y) {
  const int64_t M = y.size(0), N = y.size(1);
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr()); float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowTile)
      with_rows<kRowTile>(M - m0, [&](auto r) { tile<kQ4, Sc, decltype(r)::value, kNarrow>(xq, qp, sc, mins, yp, N, m0, n0, n1); });
  });
}
// run(scales, mins) with the accessors (BlobT: Blob or Blob16, PlainT: Plain or Plain16) a weight's scales
// call for: K-quant blobs (uint8; half groups where the blob's last dimension, ``fixed`` + ``per_half`` values
// per group, says two), fp16 / fp32 per half group (``halves``, 8-bit codes), or fp16 / fp32 per group.
template <bool kQ4, template <int> class BlobT, template <typename, int> class PlainT, typename Run>
void with_scales(const at::Tensor& sc, const c10::optional<at::Tensor>& mins, int64_t G, bool halves, int64_t fixed,
                 int64_t per_half, Run&& run) {
  if (sc.scalar_type() == at::kByte) {
    const uint8_t* mp = mins.has_value() ? mins->data_ptr<uint8_t>() : nullptr;
    if (kQ4 || (sc.size(2) - fixed) / per_half == 1) run(BlobT<1>{sc.data_ptr<uint8_t>(), G}, BlobT<1>{mp, G});
    else if constexpr (!kQ4) run(BlobT<2>{sc.data_ptr<uint8_t>(), G}, BlobT<2>{nullptr, G});
    return;
  }
  auto plain = [&](auto zero) {
    using S = decltype(zero);
    if constexpr (!kQ4) {
      if (halves) return run(PlainT<S, 2>{sc.data_ptr<S>(), G}, PlainT<S, 2>{nullptr, G});
    }
    run(PlainT<S, 1>{sc.data_ptr<S>(), G}, PlainT<S, 1>{mins.has_value() ? mins->data_ptr<S>() : nullptr, G});
  };
  if (sc.scalar_type() == at::kHalf) plain(at::Half{});
  else plain(float{});
}
// ---------------------------------------------------------------------------------------------------------
// The tiled layout, for CPUs with AVX-512 VNNI (chosen in platform.py; only called where the CPU has it).
// Weights are stored by tiles of 16 output columns so one 512-bit register holds 4 consecutive codes of each
// of the 16 columns, the operand shape of vpdpbusd (u8 x s8, 4 products summed into each int32 lane):
//   q4: [N / 16, G, 256] uint8; per (tile, group) four 64-byte chunks j = 0..3, byte 4 c + b of chunk j holds
//       column c's code k = 4 j + b (low nibble) and k = 16 + 4 j + b (high nibble);
//   q8: [N / 16, G, 512] uint8; eight chunks j = 0..7, byte 4 c + b of chunk j holds code (k = 4 j + b) + 128;
//   narrow (8-bit codes kept in 5 or 6 bits, Q5_0's and Q6_K's; read as q8): [N / 16, G, 64 bits]: four chunks
//       of low nibbles as q4's (chunk j: codes of q8's chunks j and j + 4), then the high bits: 6 bits, two
//       chunks, bits 2 s, 2 s + 1 of byte i of chunk h are those of byte i of q8's chunk 4 h + s; 5 bits, one
//       chunk, bit s of byte i is byte i of q8's chunk s's; each code is stored + 2^(bits - 1).
//   scales, mins: [N / 16, G, 16], column c of the tile in lane c.
// Activations are rounded per group to a 16-bit grid as in the row layout, with 32512 = 127 * 256 levels so
// each code splits into two signed bytes, c = 256 h + l. A row times a tile is then, per group, 16 vpdpbusd
// with the row's bytes broadcast 4 at a time (exact integer sums w . h and w . l per column), and one fp32
// fma of 256 (w . h) + w . l by scale * d; the 4-bit min term adds min * sum(x) with the exact fp32 sum of
// x. 8-bit codes are stored + 128 (unsigned); the kernel subtracts 128 * sum(activation codes) per group.
// The weights of a tile are unpacked once per group and applied to up to kRows16 rows, and a tile's outputs
// are 16 lanes, so nothing is reduced horizontally.
//
// With act_bits 8 (--activation-bits 8) the activations are rounded to 127 levels instead (llama.cpp's Q8
// blocks) and stored as the codes themselves, 32 bytes a group: a row times a tile is 8 vpdpbusd per group, half
// the work. On the demo model that raised perplexity 1.2-2.4% and changed 8% of the greedy tokens against the
// dequantized reference (docs/quantization.md), so 16 bits is the default.
//
// NOTE: as in the row layout, an output is summed by one thread in an order that depends only on K, and each
// row's activations are rounded on their own: a row's result does not depend on the other rows.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")

constexpr int kTile16 = 16;
constexpr int kRows16 = 8;  // rows per pass over a tile's weights
// Software prefetch distance along a thread's weight stream (the tiled kernels). With several rows a tile's
// dpbusd work outlasts the hardware prefetcher's lead and the loads stall: 4 KB ahead (2-8 KB measured alike)
// took the demo model's 5-token step from 1.49-1.62x a decode step to 1.35-1.38x and its 8-row LM head
// from ~1.7 to ~1.2 ms (2 threads, AVX-512 EPYC); one row is unchanged. In the row layout it measured no
// clear change and is not used.
constexpr int64_t kPrefetch = 4096;

// Activation rows for the tiled kernels: per group of a row, the 32 high bytes h then the 32 low bytes l of
// the codes c = round(x / d) = 256 h + l (h = (c + 128) >> 8, so h and l are in [-128, 127]).
struct Rows16 {
  int64_t G, stride;           // stride: bytes per group, 64 (16-bit codes as h, l) or 32 (8-bit codes)
  std::vector<int8_t> q;       // [M, G, stride]
  std::vector<float> d;        // [M, G] scales max|x| / 32512 (8-bit: / 127)
  std::vector<float> sum;      // [M, G] fp32 sums of x (the 4-bit min term)
  std::vector<int32_t> c128;   // [M, G] 128 * sum of the codes (the 8-bit + 128 offset)
  std::vector<int32_t> c128h;  // [M, G, 2] the same for each half group (codes 0-15, 16-31: Blob16<2> scales)
};
Rows16 quantize_rows16(const float* x, int64_t M, int64_t K, bool a8) {
  const int64_t G = K / kGroup, stride = a8 ? 32 : 64;
  const float kLevels = a8 ? 127.f : 32512.f;
  Rows16 o{G, stride, std::vector<int8_t>(M * G * stride), std::vector<float>(M * G), std::vector<float>(M * G),
           std::vector<int32_t>(M * G), std::vector<int32_t>(M * G * 2)};
  const __m512i k128 = _mm512_set1_epi32(128);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + m * K + g * kGroup;
      int8_t* dst = o.q.data() + (m * G + g) * stride;
      const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? kLevels / amax : 0.f);
      const __m512i ca = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), cb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
      if (a8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(ca));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(cb));
      } else {
        const __m512i ha = _mm512_srai_epi32(_mm512_add_epi32(ca, k128), 8), hb = _mm512_srai_epi32(_mm512_add_epi32(cb, k128), 8);
        const __m512i la = _mm512_sub_epi32(ca, _mm512_slli_epi32(ha, 8)), lb = _mm512_sub_epi32(cb, _mm512_slli_epi32(hb, 8));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(ha));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(hb));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32), _mm512_cvtsepi32_epi8(la));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 48), _mm512_cvtsepi32_epi8(lb));
      }
      o.d[m * G + g] = amax / kLevels;
      o.sum[m * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
      o.c128h[(m * G + g) * 2] = 128 * _mm512_reduce_add_epi32(ca);
      o.c128h[(m * G + g) * 2 + 1] = 128 * _mm512_reduce_add_epi32(cb);
      o.c128[m * G + g] = o.c128h[(m * G + g) * 2] + o.c128h[(m * G + g) * 2 + 1];
    }
  }
  return o;
}

template <typename S> inline __m512 load16(const S* p);
template <> inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16<at::Half>(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// How the tiled kernels read a weight's scales (or mins) for the 16 columns of tile t at group g (half h):
//   Plain16<S>: fp32 / fp16 values, [N / 16, G, 16];
//   Blob16<H>: K-quants' two-level scales (Blob<H> above), per tile and super-block of 8 groups the int8 subs
//     [8 groups, H, 16 columns] then the 16 columns' fp16 sups: [N / 16, G / 8, 128 H + 32] bytes.
// ``sup(t, g)`` is read once per super-block by the kernel (Plain16: nothing) and handed back to ``at``.
template <typename S, int H = 1> struct Plain16 {  // H = 2: [N / 16, G * 2, 16], one per half group
  static constexpr int kHalves = H;
  const S* p; int64_t G;
  __m512 sup(int64_t, int64_t) const { return _mm512_setzero_ps(); }
  __m512 at(int64_t t, int64_t g, int h, __m512) const { return load16<S>(p + ((t * G + g) * H + h) * kTile16); }
};
template <int H> struct Blob16 {
  static constexpr int kHalves = H;
  static constexpr int64_t kBytes = 128 * H + 32;
  const uint8_t* p; int64_t G;
  const uint8_t* block(int64_t t, int64_t g) const { return p + (t * (G / 8) + g / 8) * kBytes; }
  __m512 sup(int64_t t, int64_t g) const {
    if (p == nullptr) return _mm512_setzero_ps();
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block(t, g) + 128 * H)));
  }
  __m512 at(int64_t t, int64_t g, int h, __m512 sup) const {
    const __m128i sub = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block(t, g) + ((g % 8) * H + h) * kTile16));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sub)), sup);
  }
};

// Rows m0 .. m0 + R of y, column tiles [t0, t1). With half-group scales (8-bit codes, Blob16<2>) chunks 0-3
// (codes 0-15) and 4-7 (16-31) are summed and scaled apart.
template <bool kQ4, bool kA8, typename Sc, int R, int kNarrow = 0>
void tile16(const Rows16& xq, const uint8_t* q, const Sc& sc, const Sc& mins, float* y, int64_t N, int64_t m0,
            int64_t t0, int64_t t1) {
  const int64_t G = xq.G, bytes = kQ4 ? 256 : kNarrow ? 64 * kNarrow : 512;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t t = t0; t < t1; ++t) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    __m512 sup = _mm512_setzero_ps(), msup = sup;
    for (int64_t g = 0; g < G; ++g) {
      if (g % 8 == 0) { sup = sc.sup(t, g); if constexpr (kQ4) msup = mins.sup(t, g); }
      const uint8_t* qg = q + (t * G + g) * bytes;
      for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(qg + kPrefetch + b), _MM_HINT_T0);
      __m512i w[8];
      if constexpr (kQ4) {
        for (int j = 0; j < 4; ++j) {
          const __m512i raw = _mm512_loadu_si512(qg + 64 * j);
          w[j] = _mm512_and_si512(raw, low);
          w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
      } else if constexpr (kNarrow != 0) {  // (nibble | high bits << 4) + 128 - 2^(bits - 1): as q8 stores it
        const __m512i bias = _mm512_set1_epi8(kNarrow == 6 ? 96 : 112);
        auto shifted = [](__m512i h, int by) {  // by > 0: left (16-bit lanes: the mask below drops what crosses)
          return by > 0 ? _mm512_slli_epi16(h, by) : by < 0 ? _mm512_srli_epi16(h, -by) : h;
        };
        __m512i hi[8];
        if constexpr (kNarrow == 6) {  // chunk 4 h + s's bits at bits 2 s, 2 s + 1 of high chunk h
          const __m512i h0 = _mm512_loadu_si512(qg + 256), h1 = _mm512_loadu_si512(qg + 320), top = _mm512_set1_epi8(0x30);
          for (int s = 0; s < 4; ++s) {
            hi[s] = _mm512_and_si512(shifted(h0, 4 - 2 * s), top);
            hi[s + 4] = _mm512_and_si512(shifted(h1, 4 - 2 * s), top);
          }
        } else {  // chunk s's bit at bit s of the one high chunk
          const __m512i h = _mm512_loadu_si512(qg + 256), top = _mm512_set1_epi8(0x10);
          for (int c = 0; c < 8; ++c) hi[c] = _mm512_and_si512(shifted(h, 4 - c), top);
        }
        for (int j = 0; j < 4; ++j) {
          const __m512i raw = _mm512_loadu_si512(qg + 64 * j);
          w[j] = _mm512_add_epi8(_mm512_or_si512(_mm512_and_si512(raw, low), hi[j]), bias);
          w[j + 4] = _mm512_add_epi8(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low), hi[j + 4]), bias);
        }
      } else {
        for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(qg + 64 * j);
      }
      const __m512 ws = sc.at(t, g, 0, sup);
      if constexpr (Sc::kHalves == 2) {
        const __m512 ws2 = sc.at(t, g, 1, sup);
        for (int r = 0; r < R; ++r) {
          const int64_t row = m0 + r;
          const int32_t* xr = reinterpret_cast<const int32_t*>(xq.q.data() + (row * G + g) * xq.stride);
          __m512i s[2];
          for (int half = 0; half < 2; ++half) {
            __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
            if constexpr (kA8) {
              h0 = _mm512_dpbusd_epi32(h0, w[4 * half], _mm512_set1_epi32(xr[4 * half]));
              h1 = _mm512_dpbusd_epi32(h1, w[4 * half + 1], _mm512_set1_epi32(xr[4 * half + 1]));
              h0 = _mm512_dpbusd_epi32(h0, w[4 * half + 2], _mm512_set1_epi32(xr[4 * half + 2]));
              h1 = _mm512_dpbusd_epi32(h1, w[4 * half + 3], _mm512_set1_epi32(xr[4 * half + 3]));
              s[half] = _mm512_sub_epi32(_mm512_add_epi32(h0, h1), _mm512_set1_epi32(xq.c128h[(row * G + g) * 2 + half]));
              continue;
            }
            for (int j = 4 * half; j < 4 * half + 4; j += 2) {
              h0 = _mm512_dpbusd_epi32(h0, w[j], _mm512_set1_epi32(xr[j]));
              h1 = _mm512_dpbusd_epi32(h1, w[j + 1], _mm512_set1_epi32(xr[j + 1]));
              l0 = _mm512_dpbusd_epi32(l0, w[j], _mm512_set1_epi32(xr[8 + j]));
              l1 = _mm512_dpbusd_epi32(l1, w[j + 1], _mm512_set1_epi32(xr[9 + j]));
            }
            s[half] = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), _mm512_add_epi32(l0, l1)),
                                       _mm512_set1_epi32(xq.c128h[(row * G + g) * 2 + half]));
          }
          const __m512 d = _mm512_set1_ps(xq.d[row * G + g]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[0]), _mm512_mul_ps(ws, d), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[1]), _mm512_mul_ps(ws2, d), acc[r]);
        }
        continue;
      }
      __m512 wm;
      if constexpr (kQ4) wm = mins.at(t, g, 0, msup);
      for (int r = 0; r < R; ++r) {
        const int64_t row = m0 + r;
        const int32_t* xr = reinterpret_cast<const int32_t*>(xq.q.data() + (row * G + g) * xq.stride);
        // 256 (w . h) + w . l (8-bit: w . c), in independent chains (integer sums: any order gives the same)
        __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0, s;
        if constexpr (kA8) {
          for (int j = 0; j < 8; j += 4) {
            h0 = _mm512_dpbusd_epi32(h0, w[j], _mm512_set1_epi32(xr[j]));
            h1 = _mm512_dpbusd_epi32(h1, w[j + 1], _mm512_set1_epi32(xr[j + 1]));
            l0 = _mm512_dpbusd_epi32(l0, w[j + 2], _mm512_set1_epi32(xr[j + 2]));
            l1 = _mm512_dpbusd_epi32(l1, w[j + 3], _mm512_set1_epi32(xr[j + 3]));
          }
          s = _mm512_add_epi32(_mm512_add_epi32(h0, h1), _mm512_add_epi32(l0, l1));
        } else {
          for (int j = 0; j < 8; j += 2) {
            h0 = _mm512_dpbusd_epi32(h0, w[j], _mm512_set1_epi32(xr[j]));
            h1 = _mm512_dpbusd_epi32(h1, w[j + 1], _mm512_set1_epi32(xr[j + 1]));
            l0 = _mm512_dpbusd_epi32(l0, w[j], _mm512_set1_epi32(xr[8 + j]));
            l1 = _mm512_dpbusd_epi32(l1, w[j + 1], _mm512_set1_epi32(xr[9 + j]));
          }
          s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), _mm512_add_epi32(l0, l1));
        }
        if constexpr (!kQ4) s = _mm512_sub_epi32(s, _mm512_set1_epi32(xq.c128[row * G + g]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(ws, _mm512_set1_ps(xq.d[row * G + g])), acc[r]);
        if constexpr (kQ4) acc[r] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xq.sum[row * G + g]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N + t * kTile16, acc[r]);
  }
}
template <bool kQ4, bool kA8, typename Sc, int kNarrow = 0>
void mm_tiled_rows(const Rows16& xq, const uint8_t* qp, const Sc& sc, const Sc& mins, float* yp, int64_t M, int64_t N) {
  // A thread's tiles in blocks of kTileBlock, each block over every row tile: a block's weights stay in cache
  // while a long prompt's rows pass (a decode step has one row tile, one pass).
  constexpr int64_t kTileBlock = 8;
  at::parallel_for(0, N / kTile16, 1, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t0 = t_begin; t0 < t_end; t0 += kTileBlock) {
      const int64_t t1 = std::min(t_end, t0 + kTileBlock);
      for (int64_t m0 = 0; m0 < M; m0 += kRows16)
        with_rows<kRows16>(M - m0, [&](auto r) { tile16<kQ4, kA8, Sc, decltype(r)::value, kNarrow>(xq, qp, sc, mins, yp, N, m0, t0, t1); });
    }
  });
}
template <bool kQ4>
at::Tensor mm_tiled(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sc, const c10::optional<at::Tensor>& mins,
                    int64_t act_bits) {
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup, N = q.size(0) * kTile16;
  const bool half = sc.scalar_type() == at::kHalf, blob = sc.scalar_type() == at::kByte;
  const int64_t narrow = kQ4 || q.size(2) % 64 ? 0 : q.size(2) / 64 == 5 ? 5 : q.size(2) / 64 == 6 ? 6 : 0;
  TORCH_CHECK(q.is_contiguous() && q.size(1) == G && (q.size(2) == (kQ4 ? 256 : 512) || narrow) && sc.is_contiguous() &&
              sc.dim() == 3 && sc.size(0) == q.size(0), "tiled weight shape does not match x");
  const bool halves = !blob && !kQ4 && sc.size(1) == 2 * G;  // fp32 / fp16 per half group
  TORCH_CHECK(blob ? (G % 8 == 0 && sc.size(1) == G / 8 && (sc.size(2) == 160 || (!kQ4 && sc.size(2) == 288)))
                   : ((sc.size(1) == G || halves) && sc.size(2) == kTile16 && (half || sc.scalar_type() == at::kFloat)),
              "tiled weight scales do not match the codes");
  TORCH_CHECK(!kQ4 || (mins.has_value() && mins->sizes() == sc.sizes() && mins->is_contiguous() &&
                       mins->scalar_type() == sc.scalar_type()), "bad mins");
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"),
              "the tiled weight layout needs AVX-512 VNNI, which this CPU lacks");
  const Rows16 xq = quantize_rows16(x.data_ptr<float>(), M, K, act_bits == 8);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  with_scales<kQ4, Blob16, Plain16>(sc, mins, G, halves, 32, 128,
                                     [&](auto s, auto m) {
                                       using S = decltype(s);
                                       if constexpr (!kQ4) {
                                         if (narrow) {
                                           if (narrow == 5 && act_bits == 8) mm_tiled_rows<false, true, S, 5>(xq, qp, s, m, yp, M, N);
                                           else if (narrow == 5) mm_tiled_rows<false, false, S, 5>(xq, qp, s, m, yp, M, N);
                                           else if (act_bits == 8) mm_tiled_rows<false, true, S, 6>(xq, qp, s, m, yp, M, N);
                                           else mm_tiled_rows<false, false, S, 6>(xq, qp, s, m, yp, M, N);
                                           return;
                                         }
                                       }
                                       if (act_bits == 8) mm_tiled_rows<kQ4, true>(xq, qp, s, m, yp, M, N);
                                       else mm_tiled_rows<kQ4, false>(xq, qp, s, m, yp, M, N);
                                     });
  return y;
}

#pragma GCC pop_options

template <bool kQ4>
at::Tensor mm(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& sc, const c10::optional<at::Tensor>& mins,
              int64_t act_bits) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % kGroup == 0, "x must be [M, K] with K a multiple of 32");
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "activation bits must be 8 or 16");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  if (q.dim() == 3) return mm_tiled<kQ4>(x, q, sc, mins, act_bits).to(x_in.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = sc.size(0), G = K / kGroup;
  const bool half = sc.scalar_type() == at::kHalf, blob = sc.scalar_type() == at::kByte;
  // narrow 8-bit codes (5 or 6 bits: nibbles, then the high bits): 20 or 24 bytes a group instead of 32
  const int64_t narrow = kQ4 ? 0 : q.numel() == N * K / 32 * 20 ? 5 : q.numel() == N * K / 32 * 24 ? 6 : 0;
  TORCH_CHECK(sc.is_contiguous() && q.is_contiguous() && (q.numel() == N * K / (kQ4 ? 2 : 1) || narrow),
              "weight shape does not match x");
  const bool halves = !blob && !kQ4 && sc.size(1) == 2 * G;  // fp32 / fp16 per half group
  TORCH_CHECK(blob ? (sc.dim() == 3 && G % 8 == 0 && sc.size(1) == G / 8 && (sc.size(2) == 10 || (!kQ4 && sc.size(2) == 18)))
                   : ((half || sc.scalar_type() == at::kFloat) && (sc.size(1) == G || halves)),
              "weight scales do not match the codes");
  TORCH_CHECK(!kQ4 || (mins.has_value() && mins->sizes() == sc.sizes() && mins->is_contiguous() &&
                       mins->scalar_type() == sc.scalar_type()), "bad mins");
  const Rows xq = quantize_rows(x.data_ptr<float>(), M, K, act_bits == 8 ? 127.f : 32767.f);
  at::Tensor y = at::empty({M, N}, x.options());
  with_scales<kQ4, Blob, Plain>(sc, mins, G, halves, 2, 8, [&](auto s, auto m) {
    if constexpr (!kQ4) {
      if (narrow == 5) return mm_rows<false, decltype(s), 5>(xq, q, s, m, y);
      if (narrow == 6) return mm_rows<false, decltype(s), 6>(xq, q, s, m, y);
    }
    mm_rows<kQ4>(xq, q, s, m, y);
  });
  return y.to(x_in.scalar_type());
}
// The row layout (above) or the tiled layout (3-D codes, below): which one a weight has is its packer's
// choice (model/quant.py, CpuQuantWeight).
at::Tensor q4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& mins,
                 int64_t act_bits) {
  return mm<true>(x, packed, scale, mins, act_bits);
}

at::Tensor q8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, int64_t act_bits) {
  return mm<false>(x, codes, scale, c10::nullopt, act_bits);
}

// ---------------------------------------------------------------------------------------------------------
// Paged attention over a flat batch (model/attention.py's metadata): new token i of request r sits at
// position seq_lens[r] - q_len + i and attends keys 0 .. that position (with a sliding window w > 0: keys
// max(0, position - w + 1) .. position), read in place from the paged cache
// [2, num_blocks, block_size, Hkv, D] through the request's block table (no gather). One work item is one
// (token, KV head): its K and V rows are read once for the heads that share them (GQA). Scores, softmax
// (max-subtracted, two passes) and the weighted V sum are fp32, in key order: a row's result depends only on
// its own keys, never on the batch, the chunking or the thread count.

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 -> fp32: the 16 bits become the high half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

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

// out[h] = sum_p w[h][p] V_p for HG heads, 32 dims at a time (4 accumulators per head stay in registers),
// the rest 8 dims at a time; w[h] is at e + h * stride, V_p at rows[p] + v_off.
template <typename KV, int HG>
void weigh_values(const float* e, int64_t stride, const KV* const* rows, int64_t v_off, int64_t n, int64_t D,
                  float* out) {
  int64_t d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) {
    __m256 acc[HG][4];
    for (int h = 0; h < HG; ++h)
      for (int j = 0; j < 4; ++j) acc[h][j] = _mm256_setzero_ps();
    for (int64_t p = 0; p < n; ++p) {
      const KV* vrow = rows[p] + v_off + d0;
      __m256 v[4];
      for (int j = 0; j < 4; ++j) v[j] = load8(vrow + 8 * j);
      for (int h = 0; h < HG; ++h) {
        const __m256 w = _mm256_set1_ps(e[h * stride + p]);
        for (int j = 0; j < 4; ++j) acc[h][j] = _mm256_fmadd_ps(w, v[j], acc[h][j]);
      }
    }
    for (int h = 0; h < HG; ++h)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + h * D + d0 + 8 * j, acc[h][j]);
  }
  for (; d0 < D; d0 += 8) {
    for (int h = 0; h < HG; ++h) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t p = 0; p < n; ++p) acc = _mm256_fmadd_ps(_mm256_set1_ps(e[h * stride + p]), load8(rows[p] + v_off + d0), acc);
      _mm256_storeu_ps(out + h * D + d0, acc);
    }
  }
}

// Keys per partial softmax. A row of n keys is cut into chunks of chunk_keys(n) from its first key; each
// chunk gives, per head, its max score m, its sum of exp(score - m) l and its unnormalized output
// o = sum exp(score - m) V, and the row's output is the chunks merged in order. The cut depends only on the
// row's own key count, so a row's result is the same in any batch, chunking or thread count; a row with at
// most 64 keys has one chunk and its output is o / l, as a single softmax.
//
// Why chunks: a decode step of one request has one row, and its keys are the work to share between threads
// (flash-decoding). A chunk is all heads over consecutive cache slots, so it reads the slots' K and V rows
// (every KV head's, contiguous in the cache) front to back. One work item per (row, KV head) read a third of
// each slot's bytes at a stride, which ran at 9-10 GB/s on the 2-core EPYC against 15-19 for contiguous rows.
// About 8 chunks a row, 64 to 256 keys each: short rows keep 64 so a decode step still has several chunks to
// share, long rows merge fewer partials. Demo model, 1500-token context, fp16 cache, forward + logits,
// 2 x 15 interleaved rounds against 64-key chunks throughout: 1 token 7.8-7.9 ms (8.2), 4 tokens 11.5-11.9
// (12.3), 8 tokens 18.6-19.0 (19.7); a 300-token context alike.
inline int64_t chunk_keys(int64_t n) { return std::clamp<int64_t>((n / 8 + 63) / 64 * 64, 64, 256); }

// Reads one byte of every 64-byte line of [p, p + bytes): the lines are then in cache (a demand load, which
// the CPU cannot drop as it may a software prefetch).
inline void touch(const void* p, int64_t bytes) {
  const volatile char* c = static_cast<const volatile char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) static_cast<void>(c[b]);
}

// ---------------------------------------------------------------------------------------------------------
// The same chunk with 512-bit vectors, for CPUs with AVX-512 and head sizes that are multiples of 16 (chosen
// in attend_chunk, per CPU: a row's result still depends only on its own keys). The heads of a KV group share
// each K and V row load (up to three at a time), and a score takes D / 16 fused multiply-adds: about half the
// instructions of the 256-bit code, which a verification's extra rows spend almost all their attention time
// on (the chunk's K and V rows are in cache after the first row). These are copies of the 256-bit loops below
// at twice the width, not a shared template: code compiled for AVX-512 must stay out of the AVX2 path.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")

inline __m512 kv16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 kv16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 kv16(const at::BFloat16* p) {  // bf16 -> fp32: the 16 bits become the high half
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// exp8 (above) on 16 lanes: the same operations, so the same value in every lane.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// Four keys' sums of a[j] (16 lanes each) -> [s0, s1, s2, s3], in a fixed order.
inline __m128 sum4(const __m512 a[4]) {
  __m256 y[4];
  for (int j = 0; j < 4; ++j)
    y[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j]), 1)));
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Scores of HG heads (q rows qh, HG <= 3) of one KV group (K at offset g of each row) for the chunk's n keys.
template <typename KV, int HG>
void scores512(const float* qh, int64_t D, const KV* const* rows, int64_t g, int64_t n, float scale, float* sc,
               int64_t stride) {
  const int64_t full = n / 4 * 4;
  const __m128 vscale = _mm_set1_ps(scale);
  for (int64_t p = 0; p < full; p += 4) {
    __m512 acc[HG][4];
    for (int h = 0; h < HG; ++h)
      for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      for (int j = 0; j < 4; ++j) {
        const __m512 k = kv16(rows[p + j] + g + d);
        for (int h = 0; h < HG; ++h) acc[h][j] = _mm512_fmadd_ps(k, _mm512_loadu_ps(qh + h * D + d), acc[h][j]);
      }
    }
    for (int h = 0; h < HG; ++h) _mm_storeu_ps(sc + h * stride + p, _mm_mul_ps(sum4(acc[h]), vscale));
  }
  for (int64_t p = full; p < n; ++p) {
    for (int h = 0; h < HG; ++h) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(kv16(rows[p] + g + d), _mm512_loadu_ps(qh + h * D + d), acc);
      sc[h * stride + p] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}

// out[h] = sum_p w[h][p] V_p for HG <= 3 heads of one KV group, 64 dims at a time (each V row loaded once for
// all HG heads), the rest 16 at a time; keys in order.
template <typename KV, int HG>
void values512(const float* e, int64_t stride, const KV* const* rows, int64_t v_off, int64_t n, int64_t D,
               float* out) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) {
    __m512 acc[HG][4];
    for (int h = 0; h < HG; ++h)
      for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < n; ++p) {
      const KV* vrow = rows[p] + v_off + d0;
      __m512 v[4];
      for (int j = 0; j < 4; ++j) v[j] = kv16(vrow + 16 * j);
      for (int h = 0; h < HG; ++h) {
        const __m512 w = _mm512_set1_ps(e[h * stride + p]);
        for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_fmadd_ps(w, v[j], acc[h][j]);
      }
    }
    for (int h = 0; h < HG; ++h)
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + h * D + d0 + 16 * j, acc[h][j]);
  }
  for (; d0 < D; d0 += 16) {
    __m512 acc[HG];
    for (int h = 0; h < HG; ++h) acc[h] = _mm512_setzero_ps();
    for (int64_t p = 0; p < n; ++p) {
      const __m512 v = kv16(rows[p] + v_off + d0);
      for (int h = 0; h < HG; ++h) acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(e[h * stride + p]), v, acc[h]);
    }
    for (int h = 0; h < HG; ++h) _mm512_storeu_ps(out + h * D + d0, acc[h]);
  }
}

// attend_chunk (below) with the loops above and the softmax on 16 lanes (exp16).
template <typename KV>
void attend_chunk512(const float* q, const KV* const* rows, int64_t n, int64_t v_off, int H, int H_kv, int64_t D,
                     float scale, float* o, float* m, float* l, std::vector<float>& scores, bool load_first) {
  const int per_kv = H / H_kv;
  const int64_t stride = (n + 15) / 16 * 16;
  const int64_t row_bytes = H_kv * D * static_cast<int64_t>(sizeof(KV));
  scores.resize(static_cast<size_t>(H * stride));
  for (int h = 0; h < H; ++h) std::fill(scores.begin() + h * stride + n, scores.begin() + (h + 1) * stride, -INFINITY);
  for (int64_t p = 0; load_first && p < n; ++p) {  // every line of the chunk's K and V rows (attend_chunk's NOTE)
    touch(rows[p], row_bytes);
    touch(rows[p] + v_off, row_bytes);
  }
  for (int h0 = 0; h0 < H;) {  // heads in sets of up to three within a KV group
    const int64_t g = (h0 / per_kv) * D;
    const int hg = std::min(3, per_kv - h0 % per_kv);
    float* sc = scores.data() + h0 * stride;
    if (hg == 3) scores512<KV, 3>(q + h0 * D, D, rows, g, n, scale, sc, stride);
    else if (hg == 2) scores512<KV, 2>(q + h0 * D, D, rows, g, n, scale, sc, stride);
    else scores512<KV, 1>(q + h0 * D, D, rows, g, n, scale, sc, stride);
    h0 += hg;
  }
  for (int h = 0; h < H; ++h) {
    float* sh = scores.data() + h * stride;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t p = 0; p < stride; p += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sh + p));
    m[h] = _mm512_reduce_max_ps(mx);
    const __m512 mv = _mm512_set1_ps(m[h]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t p = 0; p < stride; p += 16) {  // padding holds -inf: exp gives (about) 0
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sh + p), mv));
      _mm512_storeu_ps(sh + p, e);
      sum = _mm512_add_ps(sum, e);
    }
    l[h] = _mm512_reduce_add_ps(sum);
  }
  for (int h0 = 0; h0 < H;) {
    const int64_t voff = v_off + (h0 / per_kv) * D;
    const int hg = std::min(3, per_kv - h0 % per_kv);
    const float* e = scores.data() + h0 * stride;
    if (hg == 3) values512<KV, 3>(e, stride, rows, voff, n, D, o + h0 * D);
    else if (hg == 2) values512<KV, 2>(e, stride, rows, voff, n, D, o + h0 * D);
    else values512<KV, 1>(e, stride, rows, voff, n, D, o + h0 * D);
    h0 += hg;
  }
}

#pragma GCC pop_options

const bool kAttention512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");

// One chunk of one row: keys rows[0 .. n) (slot bases: KV head g's K row at + g * D, its V row at + v_off),
// all H heads (q [H, D]). Writes o [H, D], m [H], l [H]; ``scores`` is scratch.
//
// NOTE: before any score, the chunk's K and V rows are read, one byte of every line (demand loads: the CPU
// keeps many in flight, as the rows' lines are independent), so they come from memory together rather than
// each on its first use; in the engine a step's weights evict them between layers. Demo model, fp16 cache,
// attention's share of a decode step (timer build, 3 alternating pairs against the loads this replaced: per
// block of 8 keys, its V rows and the next block's K rows): context 300 0.57-0.67 ms against 0.69-0.80,
// context 1400 1.88-2.08 against 2.46-2.60; 5 tokens at 300 alike (1.52-1.94 against 1.61-2.03). Those
// per-block loads had taken context ~330 from 0.86-1.12 ms to 0.68-0.80. Software prefetches of the same
// lines (per block, or the chunk's at its start) measured no gain. The loads change no result.
template <typename KV>
void attend_chunk(const float* q, const KV* const* rows, int64_t n, int64_t v_off, int H, int H_kv, int64_t D,
                  float scale, float* o, float* m, float* l, std::vector<float>& scores, bool load_first = true) {
  if (kAttention512 && D % 16 == 0) {
    attend_chunk512<KV>(q, rows, n, v_off, H, H_kv, D, scale, o, m, l, scores, load_first);
    return;
  }
  const int per_kv = H / H_kv;
  const int64_t stride = (n + 7) / 8 * 8, full = n / 8 * 8;
  const int64_t row_bytes = H_kv * D * static_cast<int64_t>(sizeof(KV));  // one slot's K (or V) row, all KV heads
  scores.assign(static_cast<size_t>(H * stride), -INFINITY);
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t p = 0; load_first && p < n; ++p) {  // every line of the chunk's K and V rows, first (see the NOTE above)
    touch(rows[p], row_bytes);
    touch(rows[p] + v_off, row_bytes);
  }
  // Scores: per block of 8 keys, every head in turn (the block's K rows, all KV heads, stay in L1).
  for (int64_t p = 0; p < full; p += 8) {
    for (int h = 0; h < H; ++h) {  // 8 keys at once, reduced together (one hadd tree)
      const float* qh = q + h * D;
      const int64_t g = (h / per_kv) * D;
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qh + d);
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, load8(rows[p + j] + g + d), a[j]);
      }
      const __m256 h4 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      const __m256 h5 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
      const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h4, h5, 0x20), _mm256_permute2f128_ps(h4, h5, 0x31));
      _mm256_storeu_ps(scores.data() + h * stride + p, _mm256_mul_ps(sums, vscale));
    }
  }
  for (int h = 0; h < H; ++h) {
    const float* qh = q + h * D;
    const int64_t g = (h / per_kv) * D;
    for (int64_t p = full; p < n; ++p) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8(rows[p] + g + d), acc);
      scores[h * stride + p] = hsum(acc) * scale;
    }
  }
  for (int h = 0; h < H; ++h) {
    float* sh = scores.data() + h * stride;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t p = 0; p < stride; p += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sh + p));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    m[h] = _mm_cvtss_f32(m4);
    const __m256 mv = _mm256_set1_ps(m[h]);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t p = 0; p < stride; p += 8) {  // padding holds -inf: exp gives 0
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + p), mv));
      _mm256_storeu_ps(sh + p, e);
      sum = _mm256_add_ps(sum, e);
    }
    l[h] = hsum(sum);
  }
  // o_h = sum_p e_p V_p, keys in order, two heads of a KV group per pass over its V rows (each V row is
  // loaded once for both; three would spill an accumulator out of AVX2's 16 registers); each output lane's
  // sum is the same whatever the grouping.
  for (int h0 = 0; h0 < H;) {
    const int64_t voff = v_off + (h0 / per_kv) * D;
    const bool pair = h0 + 1 < H && (h0 + 1) / per_kv == h0 / per_kv;
    if (pair) weigh_values<KV, 2>(scores.data() + h0 * stride, stride, rows, voff, n, D, o + h0 * D);
    else weigh_values<KV, 1>(scores.data() + h0 * stride, stride, rows, voff, n, D, o + h0 * D);
    h0 += pair ? 2 : 1;
  }
}

// A row's output from its chunks' partials (in chunk order): out_h = sum_c f_c o_c / sum_c f_c l_c with
// f_c = exp(m_c - max_c m_c). One chunk: f = 1, out = o / l.
inline void merge_chunks(const float* part, int64_t chunks, int H, int64_t D, float* out) {
  const int64_t per = H * (D + 2);  // a chunk's partial: o [H, D], then m [H], l [H]
  for (int h = 0; h < H; ++h) {
    float mx = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, part[c * per + H * D + h]);
    float denom = 0.f;
    float* oh = out + h * D;
    for (int64_t c = 0; c < chunks; ++c) {
      const float* pc = part + c * per;
      const float f = chunks == 1 ? 1.f : std::exp(pc[H * D + h] - mx);
      denom += f * pc[H * D + H + h];
      const __m256 fv = _mm256_set1_ps(f);
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 x = _mm256_mul_ps(fv, _mm256_loadu_ps(pc + h * D + d));
        _mm256_storeu_ps(oh + d, c == 0 ? x : _mm256_add_ps(_mm256_loadu_ps(oh + d), x));
      }
    }
    const __m256 iv = _mm256_set1_ps(1.f / denom);
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(oh + d, _mm256_mul_ps(_mm256_loadu_ps(oh + d), iv));
  }
}

template <typename KV>
void attention_impl(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                    const at::Tensor& qsl, const at::Tensor& seq_lens, double scale, int64_t window,
                    const int64_t* tree_base, const int64_t* tree_mask, at::Tensor& out) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = kv.size(2), H_kv = kv.size(3), R = seq_lens.size(0);
  const KV* k_cache = kv.data_ptr<KV>();
  const int64_t v_off = kv.stride(0);
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* qs = qsl.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int64_t ld_table = tables.size(1);
  const int shift = __builtin_ctzll(static_cast<unsigned long long>(block_size));  // a power of two
  const int64_t bmask = block_size - 1;
  std::vector<int64_t> req_of(T), first_of(T), n_of(T);
  // Tree tokens (model/attention_metadata.py TREE_DOC): their keys' chain positions, context then the mask's.
  std::vector<std::vector<int64_t>> tree_keys(tree_mask != nullptr ? T : 0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t q_len = qs[r + 1] - qs[r];
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t t = qs[r] + i;
      req_of[t] = r;
      int64_t pos = sl[r] - q_len + i;
      if (tree_mask != nullptr && tree_mask[t] != 0) {
        std::vector<int64_t>& keys = tree_keys[t];
        for (int64_t p = 0; p < tree_base[t]; ++p) keys.push_back(p);
        for (int64_t j = 0; j < 63; ++j)
          if ((tree_mask[t] >> j) & 1) keys.push_back(tree_base[t] + j);
        pos = static_cast<int64_t>(keys.size()) - 1;
      }
      first_of[t] = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      n_of[t] = pos + 1 - first_of[t];
    }
  }
  // Chunk c of token t: its keys first + c C .. (the slot bases of) at most C = chunk_keys(n) of them.
  auto chunk_len = [&](int64_t t, int64_t c) { return std::min(chunk_keys(n_of[t]), n_of[t] - c * chunk_keys(n_of[t])); };
  auto chunk_rows = [&](int64_t t, int64_t c, std::vector<const KV*>& rows) -> int64_t {
    const int64_t ck = chunk_keys(n_of[t]), k0 = c * ck, nc = chunk_len(t, c);
    const int32_t* table = tp + req_of[t] * ld_table;
    const int64_t* key_pos = tree_keys.empty() || tree_keys[t].empty() ? nullptr : tree_keys[t].data();
    rows.resize(static_cast<size_t>(nc));
    for (int64_t i = 0; i < nc; ++i) {
      const int64_t p = key_pos != nullptr ? key_pos[first_of[t] + k0 + i] : first_of[t] + k0 + i;
      rows[i] = k_cache + ((static_cast<int64_t>(table[p >> shift]) << shift) + (p & bmask)) * H_kv * D;
    }
    return nc;
  };
  auto chunks_of = [&](int64_t t) { return (n_of[t] + chunk_keys(n_of[t]) - 1) / chunk_keys(n_of[t]); };
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t per = H * (D + 2);  // a chunk's partial: o [H, D], m [H], l [H]
  // Chunk c of token t into the partial at pc (rows, scores: the calling thread's scratch).
  // load_first: read the chunk's lines before its first score (false where this thread has just read them).
  auto run_chunk = [&](int64_t t, int64_t c, float* pc, std::vector<const KV*>& rows, std::vector<float>& scores,
                       bool load_first) {
    const int64_t nc = chunk_rows(t, c, rows);
    attend_chunk<KV>(qp + t * H * D, rows.data(), nc, v_off, static_cast<int>(H), static_cast<int>(H_kv), D,
                     static_cast<float>(scale), pc, pc + H * D, pc + H * D + H, scores, load_first);
  };
  if (T <= 16) {
    // Few rows (decode and verification steps): one work item per chunk, then the merges. Items go chunk by
    // chunk through a request's tokens, so a verification's tokens read each chunk while it is in cache.
    std::vector<int64_t> start(T + 1, 0);
    for (int64_t t = 0; t < T; ++t) start[t + 1] = start[t] + chunks_of(t);
    std::vector<std::pair<int64_t, int64_t>> items;  // (token, chunk)
    items.reserve(static_cast<size_t>(start[T]));
    for (int64_t r = 0; r < R; ++r) {
      int64_t most = 0;
      for (int64_t t = qs[r]; t < qs[r + 1]; ++t) most = std::max(most, chunks_of(t));
      for (int64_t c = 0; c < most; ++c)
        for (int64_t t = qs[r]; t < qs[r + 1]; ++t)
          if (c < chunks_of(t)) items.emplace_back(t, c);
    }
    std::vector<float> part(static_cast<size_t>(start[T] * per));
    // Each thread takes a contiguous run of items (a chunk's rows stay in one core's cache) holding an equal
    // share of the keys: a split by item count gave one thread the short last chunks and left the other
    // waiting ~15 % of a 6-row verification at 1400 keys.
    const int64_t num_items = static_cast<int64_t>(items.size());
    std::vector<int64_t> cum(num_items + 1, 0);
    for (int64_t i = 0; i < num_items; ++i) {
      const auto [t, c] = items[i];
      cum[i + 1] = cum[i] + chunk_len(t, c);
    }
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
    at::parallel_for(0, threads, 1, [&](int64_t j0, int64_t j1) {
      std::vector<float> scores;
      std::vector<const KV*> rows;
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t i0 = std::lower_bound(cum.begin(), cum.end(), cum[num_items] * j / threads) - cum.begin();
        const int64_t i1 = std::lower_bound(cum.begin(), cum.end(), cum[num_items] * (j + 1) / threads) - cum.begin();
        for (int64_t i = i0; i < i1; ++i) {
          const auto [t, c] = items[i];
          // The request's previous token in this run read the same chunk: its lines are in this core's cache
          // (reading them again first cost ~10 % of such a row's attention).
          const bool cached = i > i0 && items[i - 1].second == c && req_of[items[i - 1].first] == req_of[t];
          run_chunk(t, c, part.data() + (start[t] + c) * per, rows, scores, !cached);
        }
      }
    });
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        merge_chunks(part.data() + start[t] * per, chunks_of(t), static_cast<int>(H), D, op + t * H * D);
    });
    return;
  }
  // Many rows (prefill): one work item per row, its chunks in turn (the same partials, merged the same way).
  // Items zig-zag over the rows (first, last, second, ...): a prompt's rows grow in length, and each thread
  // takes a contiguous range of items, so this gives every thread about the same number of keys.
  at::parallel_for(0, T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores, part;
    std::vector<const KV*> rows;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i % 2 == 0 ? i / 2 : T - 1 - i / 2;
      const int64_t chunks = chunks_of(t);
      part.resize(static_cast<size_t>(chunks * per));
      for (int64_t c = 0; c < chunks; ++c) run_chunk(t, c, part.data() + c * per, rows, scores, true);
      merge_chunks(part.data(), chunks, static_cast<int>(H), D, op + t * H * D);
    }
  });
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                           int64_t window, const std::optional<at::Tensor>& tree_base = std::nullopt,
                           const std::optional<at::Tensor>& tree_mask = std::nullopt) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && kv_cache.is_contiguous(), "bad attention shapes");
  TORCH_CHECK(query.size(2) % 8 == 0 && query.size(2) == kv_cache.size(4), "head_dim must be a multiple of 8");
  TORCH_CHECK((kv_cache.size(2) & (kv_cache.size(2) - 1)) == 0, "the KV block size must be a power of two");
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
  } else if (kv_cache.scalar_type() == at::kHalf) {
    attention_impl<at::Half>(q, kv_cache, tables, qsl, sl, scale, window, tbp, tmp, out);
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16, "KV cache must be float32, float16 or bfloat16");
    attention_impl<at::BFloat16>(q, kv_cache, tables, qsl, sl, scale, window, tbp, tmp, out);
  }
  return out.to(query.scalar_type());
}

// ---------------------------------------------------------------------------------------------------------
// Fused small ops of a decoder layer (fp32), each a row-by-row loop: (residual add +) RMSNorm, and rotary
// embedding of q and k with the K/V write into the paged cache.

// y = x / sqrt(mean(x^2) + eps) * w for each row of x [T, Hd]; with delta: h += delta first (in place).
// w_rows > 1: row t takes weight row t % w_rows of w [w_rows, Hd] (a row of several vectors normed apart).
void add_rms_norm_rows(float* h, const float* delta, const float* w_all, float* y, int64_t T, int64_t Hd, double eps,
                       int64_t w_rows = 1) {
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
      const float* w = w_all + (t % w_rows) * Hd;
      float* yr = y + t * Hd;
      for (int64_t i = 0; i < Hd; ++i) yr[i] = w[i] * (hr[i] * inv);
    }
  });
}

// weight [Hd], or [C, Hd] for rows of C vectors each normed on its own (x [..., C * Hd]).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: fp32 only");
  TORCH_CHECK(weight.dim() <= 2 && weight.numel() == x.size(-1), "rms_norm: weight does not match x");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t Hd = weight.size(-1), chunks = weight.dim() == 2 ? weight.size(0) : 1;
  add_rms_norm_rows(xc.data_ptr<float>(), nullptr, weight.contiguous().data_ptr<float>(), y.data_ptr<float>(),
                    xc.numel() / Hd, Hd, eps, chunks);
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
// k (rotated) and v are written to kv_cache [2, blocks, block_size, Hkv, D] at slot_mapping[t], rounded to
// the cache's dtype (fp32, fp16 or bf16; round to nearest even, as torch's .to()).
template <typename KV>
void rope_write_rows(const float* src, const int64_t* pp, const int64_t* slp, const float* cp, const float* sp,
                     float* qp, KV* kc, KV* vc, int64_t T, int64_t H, int64_t Hkv, int64_t D) {
  const int64_t half = D / 2, width = (H + 2 * Hkv) * D;
  auto rotate = [&](const float* x, const float* c, const float* s, auto* out) {
    using O = std::remove_pointer_t<decltype(out)>;
    for (int64_t i = 0; i < half; ++i) {
      out[i] = static_cast<O>(x[i] * c[i] - x[i + half] * s[i]);
      out[i + half] = static_cast<O>(x[i + half] * c[i + half] + x[i] * s[i + half]);
    }
  };
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = src + t * width;
      const float* c = cp + pp[t] * D;
      const float* s = sp + pp[t] * D;
      for (int64_t h = 0; h < H; ++h) rotate(row + h * D, c, s, qp + (t * H + h) * D);
      KV* kdst = kc + slp[t] * Hkv * D;
      KV* vdst = vc + slp[t] * Hkv * D;
      for (int64_t h = 0; h < Hkv; ++h) rotate(row + (H + h) * D, c, s, kdst + h * D);
      const float* v = row + (H + Hkv) * D;
      for (int64_t i = 0; i < Hkv * D; ++i) vdst[i] = static_cast<KV>(v[i]);
    }
  });
}

at::Tensor rope_write_kv(const at::Tensor& qkv_in, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor kv_cache, const at::Tensor& slot_mapping,
                         int64_t H, int64_t Hkv) {
  TORCH_CHECK(qkv_in.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat, "rope_write_kv: fp32 only");
  TORCH_CHECK(kv_cache.is_contiguous() && positions.scalar_type() == at::kLong &&
              slot_mapping.scalar_type() == at::kLong, "rope_write_kv: bad cache or index dtypes");
  const at::Tensor qkv = qkv_in.contiguous(), pos = positions.contiguous(), slots = slot_mapping.contiguous();
  const int64_t T = qkv.size(0), D = kv_cache.size(4), width = qkv.size(1);
  TORCH_CHECK(width == (H + 2 * Hkv) * D && kv_cache.size(3) == Hkv, "rope_write_kv: shapes do not match");
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.contiguous().data_ptr<float>();
  const float* sp = sin.contiguous().data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* slp = slots.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  const int64_t vstride = kv_cache.stride(0);
  switch (kv_cache.scalar_type()) {
    case at::kFloat: {
      float* kc = kv_cache.data_ptr<float>();
      rope_write_rows<float>(src, pp, slp, cp, sp, qp, kc, kc + vstride, T, H, Hkv, D);
      break;
    }
    case at::kHalf: {
      at::Half* kc = kv_cache.data_ptr<at::Half>();
      rope_write_rows<at::Half>(src, pp, slp, cp, sp, qp, kc, kc + vstride, T, H, Hkv, D);
      break;
    }
    case at::kBFloat16: {
      at::BFloat16* kc = kv_cache.data_ptr<at::BFloat16>();
      rope_write_rows<at::BFloat16>(src, pp, slp, cp, sp, qp, kc, kc + vstride, T, H, Hkv, D);
      break;
    }
    default: TORCH_CHECK(false, "rope_write_kv: the KV cache must be float32, float16 or bfloat16");
  }
  return q;
}

// act [T, I] = silu(g) * u for gu [T, 2 I] = [g ; u] (fp32): silu(g) = g / (1 + exp(-g)), exp as exp8 (the
// argument clamped to 88 so exp(-g) stays finite; g / 2e38 is 0 to fp32 anyway), one exact division. Each
// element's result depends only on its own g and u (row invariance). Two torch ops on views cost ~4.6 us a
// layer in dispatch and allocation at one row (0.14 ms of a demo-model decode step).
at::Tensor silu_mul(const at::Tensor& gu_in) {
  TORCH_CHECK(gu_in.scalar_type() == at::kFloat && gu_in.dim() == 2 && gu_in.size(1) % 2 == 0,
              "silu_mul: fp32 [T, 2 I]");
  const at::Tensor gu = gu_in.contiguous();
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  at::Tensor act = at::empty({T, I}, gu.options());
  const float* src = gu.data_ptr<float>();
  float* dst = act.data_ptr<float>();
  auto eight = [](const float* g, const float* u, float* out) {
    const __m256 gv = _mm256_loadu_ps(g);
    const __m256 e = exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), _mm256_set1_ps(88.f)));
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e)), _mm256_loadu_ps(u)));
  };
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = src + t * 2 * I;
      const float* u = g + I;
      float* o = dst + t * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) eight(g + i, u + i, o + i);
      if (i < I) {  // the tail through the same 8-lane code (padding lanes are discarded)
        float gt[8] = {0.f}, ut[8] = {0.f}, ot[8];
        std::copy(g + i, g + I, gt);
        std::copy(u + i, u + I, ut);
        eight(gt, ut, ot);
        std::copy(ot, ot + (I - i), o + i);
      }
    }
  });
  return act;
}

// ---------------------------------------------------------------------------------------------------------
// One whole decoder layer (Llama-style: pre-norm attention and gated SiLU MLP) in one call, so a decode step
// costs one dispatch per layer instead of about fifteen. It calls exactly the functions the per-op path
// calls, in the same order, so its result is bit-for-bit that path's. A matmul weight is (codes, scale, mins):
// 4-bit when mins is given, 8-bit codes otherwise.
at::Tensor qmm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
               const c10::optional<at::Tensor>& mins, int64_t act_bits) {
  return mins.has_value() ? mm<true>(x, codes, scale, mins, act_bits)
                          : mm<false>(x, codes, scale, c10::nullopt, act_bits);
}

// (h + delta, the layer's output delta); h + delta is the residual stream after the previous layer (delta
// None: h itself, the first layer). Neither h nor delta is modified. ``qkv2``: a second q/k/v weight whose
// output rows follow the first's (parts of two formats, model/quant.py's ConcatWeight: Q4_K q/k, Q6_K v).
std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& h, const c10::optional<at::Tensor>& delta, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& qkv_codes, const at::Tensor& qkv_scale,
    const c10::optional<at::Tensor>& qkv_mins, const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o_codes,
    const at::Tensor& o_scale, const c10::optional<at::Tensor>& o_mins, const at::Tensor& gate_up_codes,
    const at::Tensor& gate_up_scale, const c10::optional<at::Tensor>& gate_up_mins, const at::Tensor& down_codes,
    const at::Tensor& down_scale, const c10::optional<at::Tensor>& down_mins, const at::Tensor& positions,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor kv_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t H,
    int64_t Hkv, double scale, int64_t window, const std::optional<at::Tensor>& tree_base,
    const std::optional<at::Tensor>& tree_mask, const c10::optional<at::Tensor>& qkv2_codes = c10::nullopt,
    const c10::optional<at::Tensor>& qkv2_scale = c10::nullopt, const c10::optional<at::Tensor>& qkv2_mins = c10::nullopt,
    int64_t act_bits = 16) {
  at::Tensor res, x;
  if (delta.has_value()) {
    std::tie(res, x) = add_rms_norm(h, *delta, input_norm, eps);
  } else {
    res = h.contiguous().clone();
    x = rms_norm(res, input_norm, eps);
  }
  at::Tensor qkv = qmm(x, qkv_codes, qkv_scale, qkv_mins, act_bits);
  if (qkv2_codes.has_value()) {
    TORCH_CHECK(qkv2_scale.has_value(), "decoder_layer: qkv2_codes without qkv2_scale");
    qkv = at::cat({qkv, qmm(x, *qkv2_codes, *qkv2_scale, qkv2_mins, act_bits)}, -1);
  }
  if (qkv_bias.has_value()) qkv = qkv + *qkv_bias;
  const at::Tensor q = rope_write_kv(qkv, positions, cos, sin, kv_cache, slot_mapping, H, Hkv);
  const at::Tensor a = paged_attention(q, kv_cache, block_tables, query_start_loc, seq_lens, scale, window,
                                       tree_base, tree_mask);
  const at::Tensor o = qmm(a.reshape({a.size(0), -1}), o_codes, o_scale, o_mins, act_bits);
  const int64_t Hd = res.size(-1);  // res += o, x = norm(res): in place (res is this call's own tensor)
  add_rms_norm_rows(res.data_ptr<float>(), o.data_ptr<float>(), post_norm.contiguous().data_ptr<float>(),
                    x.data_ptr<float>(), res.numel() / Hd, Hd, eps);
  const at::Tensor act = silu_mul(qmm(x, gate_up_codes, gate_up_scale, gate_up_mins, act_bits));
  return {res, qmm(act, down_codes, down_scale, down_mins, act_bits)};
}

}  // namespace

// Layers in turn, each as decoder_layer: one call per forward instead of one per layer (the per-call Python
// and dispatch cost, ~30 arguments parsed, times the layer count). Per-layer arguments come as lists, one
// entry per layer; ``taps``: 0-based layers whose output h + delta is also returned (an EAGLE head's
// features). ``h``: the first layer's input (no delta pending). Returns (h, delta) after the last layer, as
// the layer loop in Python would have them.
std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> decoder_stack(
    const at::Tensor& h_in, at::TensorList input_norms,
    at::TensorList post_norms, double eps, at::TensorList qkv_codes, at::TensorList qkv_scales,
    const c10::List<c10::optional<at::Tensor>>& qkv_mins, const c10::List<c10::optional<at::Tensor>>& qkv_biases,
    at::TensorList o_codes, at::TensorList o_scales, const c10::List<c10::optional<at::Tensor>>& o_mins,
    at::TensorList gate_up_codes, at::TensorList gate_up_scales,
    const c10::List<c10::optional<at::Tensor>>& gate_up_mins, at::TensorList down_codes, at::TensorList down_scales,
    const c10::List<c10::optional<at::Tensor>>& down_mins, const at::Tensor& positions, at::TensorList cos,
    at::TensorList sin, at::TensorList kv_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens, int64_t H, int64_t Hkv, double scale,
    at::IntArrayRef windows, at::IntArrayRef taps, const c10::List<c10::optional<at::Tensor>>& qkv2_codes,
    const c10::List<c10::optional<at::Tensor>>& qkv2_scales, const c10::List<c10::optional<at::Tensor>>& qkv2_mins,
    const std::optional<at::Tensor>& tree_base, const std::optional<at::Tensor>& tree_mask, int64_t act_bits) {
  const size_t L = kv_caches.size();
  TORCH_CHECK(L > 0, "decoder_stack: no layers");
  TORCH_CHECK(input_norms.size() == L && post_norms.size() == L && qkv_codes.size() == L &&
              qkv_scales.size() == L && qkv_mins.size() == L && qkv_biases.size() == L && o_codes.size() == L &&
              o_scales.size() == L && o_mins.size() == L && gate_up_codes.size() == L &&
              gate_up_scales.size() == L && gate_up_mins.size() == L && down_codes.size() == L &&
              down_scales.size() == L && down_mins.size() == L && cos.size() == L && sin.size() == L &&
              windows.size() == L && qkv2_codes.size() == L && qkv2_scales.size() == L && qkv2_mins.size() == L,
              "decoder_stack: one entry per layer in every list");
  at::Tensor h = h_in;
  c10::optional<at::Tensor> delta;
  std::vector<at::Tensor> kept;
  size_t next_tap = 0;
  for (size_t i = 0; i < L; ++i) {
    at::Tensor kv = kv_caches[i];
    auto [h2, d2] = decoder_layer(h, delta, input_norms[i], post_norms[i], eps, qkv_codes[i], qkv_scales[i],
                                  qkv_mins.get(i), qkv_biases.get(i), o_codes[i], o_scales[i], o_mins.get(i),
                                  gate_up_codes[i], gate_up_scales[i], gate_up_mins.get(i), down_codes[i],
                                  down_scales[i], down_mins.get(i), positions, cos[i], sin[i], kv, slot_mapping,
                                  block_tables, query_start_loc, seq_lens, H, Hkv, scale, windows[i], tree_base,
                                  tree_mask, qkv2_codes.get(i), qkv2_scales.get(i), qkv2_mins.get(i), act_bits);
    h = std::move(h2);
    delta = std::move(d2);
    if (next_tap < taps.size() && taps[next_tap] == static_cast<int64_t>(i)) {
      kept.push_back(h + *delta);
      ++next_tap;
    }
  }
  TORCH_CHECK(next_tap == taps.size(), "decoder_stack: taps must be increasing layer indices below the layer count");
  return {h, *delta, kept};
}

TORCH_LIBRARY(specserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("add_rms_norm(Tensor h, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_write_kv(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) kv_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads) -> Tensor");
  m.def("q4_mm(Tensor x, Tensor packed, Tensor scale, Tensor mins, int act_bits=16) -> Tensor");
  m.def("q8_mm(Tensor x, Tensor codes, Tensor scale, int act_bits=16) -> Tensor");
  m.def("paged_attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor query_start_loc, "
        "Tensor seq_lens, float scale, int window, Tensor? tree_base=None, Tensor? tree_mask=None) -> Tensor");
  m.def("decoder_layer(Tensor h, Tensor? delta, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor qkv_codes, Tensor qkv_scale, Tensor? qkv_mins, Tensor? qkv_bias, Tensor o_codes, Tensor o_scale, "
        "Tensor? o_mins, Tensor gate_up_codes, Tensor gate_up_scale, Tensor? gate_up_mins, Tensor down_codes, "
        "Tensor down_scale, Tensor? down_mins, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) kv_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, int num_heads, "
        "int num_kv_heads, float scale, int window, Tensor? tree_base=None, Tensor? tree_mask=None, "
        "Tensor? qkv2_codes=None, Tensor? qkv2_scale=None, Tensor? qkv2_mins=None, int act_bits=16) -> (Tensor, Tensor)");
  m.def("decoder_stack(Tensor h, Tensor[] input_norms, Tensor[] post_norms, float eps, "
        "Tensor[] qkv_codes, Tensor[] qkv_scales, Tensor?[] qkv_mins, Tensor?[] qkv_biases, Tensor[] o_codes, "
        "Tensor[] o_scales, Tensor?[] o_mins, Tensor[] gate_up_codes, Tensor[] gate_up_scales, "
        "Tensor?[] gate_up_mins, Tensor[] down_codes, Tensor[] down_scales, Tensor?[] down_mins, "
        "Tensor positions, Tensor[] cos, Tensor[] sin, Tensor(a!)[] kv_caches, Tensor slot_mapping, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, int num_heads, int num_kv_heads, "
        "float scale, int[] windows, int[] taps, Tensor?[] qkv2_codes, Tensor?[] qkv2_scales, "
        "Tensor?[] qkv2_mins, Tensor? tree_base=None, Tensor? tree_mask=None, int act_bits=16) -> (Tensor, Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) {
  m.impl("q4_mm", q4_mm);
  m.impl("q8_mm", q8_mm);
  m.impl("paged_attention", paged_attention);
  m.impl("rms_norm", rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rope_write_kv", rope_write_kv);
  m.impl("decoder_layer", decoder_layer);
  m.impl("decoder_stack", decoder_stack);
}
