// Integer dot-product linear layers for one-token decode steps on CPU (kernels_cpu.py builds this file,
// gemm_cpu.cpp (the same products over a prompt's rows) and attention_cpu.cpp at first use with the flags of the
// detected CPU kind and registers their ops under the namespace KVFAST_NS; kernels_cpu.h is what they share).
//
// llama.cpp's scheme: each activation row is quantized per block of 32 columns to int8 (Q8_0: one fp32 scale
// d = max|x| / 127 per block), multiplied with the weight codes in int32 (exact), and each block's integer sum
// is scaled in fp32. Weight formats are quantize.py's, read in place:
//   int8: codes int8 [out, in], one fp32 scale per output row;
//   int4: codes uint8 [out, in / 2] (column j in the low nibble, j + in / 2 in the high one), fp32 scale and
//         offset per output row and group of `in / n_groups` columns: w = code * scale + offset.
// y[o] = sum_b d_b * ws * sum_{c in b} code * q_c  (+ sum_g offset[o, g] * sum_{c in g} x_c for int4: the
// offsets meet the exact activations).
//
// Vector paths: AVX-512 VNNI (_mm512_dpbusd_epi32; the int8 codes are made unsigned by flipping their sign
// bit, code + 128, and 128 * sum q is subtracted per lane), AVX2 (_mm256_maddubs_epi16: int8 codes as |code|
// against the activations carrying the code's sign, so no pair saturates), and plain C++.

#include "kernels_cpu.h"

namespace {

// Rows ahead whose bytes are prefetched (a hint: past the matrix's end it never faults).
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 8
#endif
// Bytes ahead of an int4 tiled product's loads that are prefetched: its tiles cross pages, where the hardware's
// stream stops (30 layers of SmolLM2's int4 products 1.07-1.17x faster; int8's tiles gained nothing).
#ifndef TILE_AHEAD
#define TILE_AHEAD 4096
#endif
inline void prefetch_ahead(const uint8_t* p) { __builtin_prefetch(p + TILE_AHEAD); }

#if defined(KVFAST_AVX512)
// NR output rows at once: each activation vector is loaded once for all of them, and NR independent
// accumulation chains keep the loads of NR weight rows in flight.
template <int NR>
inline void int8_dots(const int8_t* w, int64_t in, const QRow& r, float* out) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[NR];
  for (int k = 0; k < NR; ++k) acc[k] = _mm512_setzero_ps();
  for (int64_t c = 0; c < in; c += 64) {
    const bool tail = c + 64 > in;  // in is a multiple of 32
    const __mmask64 m8 = tail ? 0xFFFFFFFFull : ~0ull;
    const __mmask16 m32 = tail ? 0xFF : 0xFFFF;
    const __m512i q = _mm512_maskz_loadu_epi8(m8, r.q + c);
    const __m512i bias = _mm512_maskz_loadu_epi32(m32, r.bias + c / 4);
    const __m512 d = _mm512_maskz_loadu_ps(m32, r.d_lane + c / 4);
#pragma GCC unroll 8
    for (int k = 0; k < NR; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + PREFETCH_ROWS) * in + c), _MM_HINT_T0);
      const __m512i wu = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m8, w + k * in + c), flip);
      acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(bias, wu, q)), d, acc[k]);
    }
  }
  for (int k = 0; k < NR; ++k) out[k] = _mm512_reduce_add_ps(acc[k]);
}

// 16 lanes of 4 columns from column `col`: lanes 0-7 take the scale of col's group, lanes 8-15 col + 32's
// (past the row's last column, lanes that the tail's masks drop: its last group again, never the next row's).
inline __m512 group_lanes(const float* s, int64_t col, int gshift, int64_t in) {
  const int64_t next = std::min(col + 32, in - 1);
  return _mm512_mask_mov_ps(_mm512_set1_ps(s[col >> gshift]), 0xFF00, _mm512_set1_ps(s[next >> gshift]));
}

template <int NR>
inline void int4_dots(const uint8_t* w, const float* ws, const float* off, const QRow& r, int64_t in, int gshift,
                      float* out) {
  const int64_t half = in / 2, n_groups = in >> gshift;
  const __m512i nib = _mm512_set1_epi8(15);
  __m512 acc[NR];
  for (int k = 0; k < NR; ++k) acc[k] = _mm512_setzero_ps();
  for (int64_t c = 0; c < half; c += 64) {
    const bool tail = c + 64 > half;  // half is a multiple of 32
    const __mmask64 m8 = tail ? 0xFFFFFFFFull : ~0ull;
    const __mmask16 m32 = tail ? 0xFF : 0xFFFF;
    const __m512i qlo = _mm512_maskz_loadu_epi8(m8, r.q + c);
    const __m512i qhi = _mm512_maskz_loadu_epi8(m8, r.q + half + c);
    const __m512 dlo = _mm512_maskz_loadu_ps(m32, r.d_lane + c / 4);
    const __m512 dhi = _mm512_maskz_loadu_ps(m32, r.d_lane + (half + c) / 4);
#pragma GCC unroll 8
    for (int k = 0; k < NR; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + PREFETCH_ROWS) * half + c), _MM_HINT_T0);
      const __m512i bytes = _mm512_maskz_loadu_epi8(m8, w + k * half + c);
      const __m512i lo = _mm512_and_si512(bytes, nib);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nib);
      const __m512i slo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, qlo);
      const __m512i shi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, qhi);
      const float* s = ws + k * n_groups;
      acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(slo), _mm512_mul_ps(dlo, group_lanes(s, c, gshift, in)), acc[k]);
      acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(shi), _mm512_mul_ps(dhi, group_lanes(s, half + c, gshift, in)),
                               acc[k]);
    }
  }
  for (int k = 0; k < NR; ++k) {
    __m512 o = _mm512_setzero_ps();
    for (int64_t g = 0; g < n_groups; g += 16) {
      const __mmask16 m = n_groups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n_groups - g)) - 1);
      o = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, off + k * n_groups + g),
                          _mm512_maskz_loadu_ps(m, r.group_sum + g), o);
    }
    out[k] = _mm512_reduce_add_ps(acc[k]) + _mm512_reduce_add_ps(o);
  }
}

// ---- tiled layouts (kernels_cpu.py tile_int8 / tile_int4): 16 output rows side by side -------------------------
// A row-major product reduces each row across its lanes: for rows as short as a 135M model's (288 bytes of int4
// codes) the horizontal sums and per-group scale shuffles cost more than the loads. In tiles of 16 rows, lane r
// of every vector is output row r: four columns of 16 rows are one 64-byte load and one dpbusd against those
// columns' activations broadcast, the group scales of 16 rows are one load, and the tile's 16 outputs one store.

// int8 tile: [in / 4][16 rows][4 columns] of code + 128 (uint8); y[0..16) = the 16 outputs times the rows' scales.
inline void int8_tile_dots(const uint8_t* w, const QRow& r, int64_t in, const float* scales, float* y) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < in; b += QK) {
    const uint8_t* wb = w + b * TR;
    __m512i s[4] = {_mm512_set1_epi32(r.block_bias[b / QK]), _mm512_setzero_si512(), _mm512_setzero_si512(),
                    _mm512_setzero_si512()};
#pragma GCC unroll 8
    for (int k = 0; k < QK / 4; ++k)
      s[k % 4] = _mm512_dpbusd_epi32(s[k % 4], _mm512_loadu_si512(wb + 64 * k), broadcast4(r.q + b + 4 * k));
    const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(s[0], s[1]), _mm512_add_epi32(s[2], s[3]));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(r.d_lane[b / 4]), acc);
  }
  _mm512_storeu_ps(y, _mm512_mul_ps(acc, _mm512_loadu_ps(scales)));
}

// int4 tile: [in / 8][16 rows][4 bytes], byte i of a row holding column 8c + i in its low nibble and 8c + 4 + i in
// its high one; scales and offsets [n_groups][16 rows], fp32 or float16 (S); y[0..16) = the 16 outputs.
template <typename S>
inline void int4_tile_dots(const uint8_t* w, const S* ws, const S* off, const QRow& r, int64_t in, int64_t group,
                           float* y) {
  // the high nibbles are multiplied in place (16 x code, at most 240 * 127 * 32 in a block: no overflow) and
  // the low ones' sums scaled by 16 to match, which saves a shift per load; d / 16 undoes it (exact).
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < in / group; ++g) {
    __m512 gacc = _mm512_setzero_ps();
    for (int64_t b = g * group; b < (g + 1) * group; b += QK) {
      const uint8_t* wb = w + b * TR / 2;
      __m512i lo[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      __m512i hi[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        prefetch_ahead(wb + 64 * k);
        const __m512i bytes = _mm512_loadu_si512(wb + 64 * k);
        lo[k % 2] = _mm512_dpbusd_epi32(lo[k % 2], _mm512_and_si512(bytes, low), broadcast4(r.q + b + 8 * k));
        hi[k % 2] = _mm512_dpbusd_epi32(hi[k % 2], _mm512_and_si512(bytes, high),
                                        broadcast4(r.q + b + 8 * k + 4));
      }
      const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(lo[0], lo[1]), 4),
                                           _mm512_add_epi32(hi[0], hi[1]));
      gacc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(r.d_lane[b / 4] * 0.0625f), gacc);
    }
    acc = _mm512_fmadd_ps(gacc, load16(ws + g * TR), acc);
    acc = _mm512_fmadd_ps(load16(off + g * TR), _mm512_set1_ps(r.group_sum[g]), acc);
  }
  _mm512_storeu_ps(y, acc);
}

#elif defined(KVFAST_AVX2)
// A row's codes stream in order (rows side by side would interleave their streams, which from memory ran at
// half the speed); two blocks a step into two accumulators, so a step does not wait on the last multiply-add.
inline float int8_dot(const int8_t* w, const QRow& r, int64_t in) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const auto block = [&](int64_t c, __m256& a) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c));
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.q + c));
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(qv, wv));
    a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), _mm256_set1_ps(r.d_lane[c / 4]), a);
  };
  int64_t c = 0;
  for (; c + 64 <= in; c += 64) {
    block(c, acc[0]);
    block(c + 32, acc[1]);
  }
  if (c < in) block(c, acc[0]);  // in is a multiple of 32
  return hsum8(_mm256_add_ps(acc[0], acc[1]));
}

// NR output rows at once (as in the AVX-512 build): the activations are loaded once for all of them, and the
// rows' low and high nibbles accumulate in 2 NR independent chains.
template <int NR>
inline void int4_dots(const uint8_t* w, const float* ws, const float* off, const QRow& r, int64_t in, int gshift,
                      float* out) {
  const int64_t half = in / 2, n_groups = in >> gshift;
  const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 lo_acc[NR], hi_acc[NR];
  for (int k = 0; k < NR; ++k) lo_acc[k] = hi_acc[k] = _mm256_setzero_ps();
  for (int64_t c = 0; c < half; c += 32) {
    const __m256i qlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.q + c));
    const __m256i qhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.q + half + c));
    const float dlo = r.d_lane[c / 4], dhi = r.d_lane[(half + c) / 4];
#pragma GCC unroll 8
    for (int k = 0; k < NR; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + PREFETCH_ROWS) * half + c), _MM_HINT_T0);
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * half + c));
      const __m256i lo = _mm256_and_si256(bytes, nib);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nib);
      const __m256i slo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, qlo), ones);
      const __m256i shi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, qhi), ones);
      const float* s = ws + k * n_groups;
      lo_acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(slo), _mm256_set1_ps(dlo * s[c >> gshift]), lo_acc[k]);
      hi_acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(shi), _mm256_set1_ps(dhi * s[(half + c) >> gshift]), hi_acc[k]);
    }
  }
  for (int k = 0; k < NR; ++k) {  // the offsets times the groups' activation sums, 8 groups a step
    __m256 o = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= n_groups; g += 8)
      o = _mm256_fmadd_ps(_mm256_loadu_ps(off + k * n_groups + g), _mm256_loadu_ps(r.group_sum + g), o);
    float tail = 0.f;
    for (; g < n_groups; ++g) tail += off[k * n_groups + g] * r.group_sum[g];
    out[k] = hsum8(_mm256_add_ps(lo_acc[k], hi_acc[k])) + hsum8(o) + tail;
  }
}

// ---- tiled layouts (as in the AVX-512 build): each 64 bytes of a tile are two vectors of 8 rows -------------------
// int8 tile (code + 128): the codes' sign restored (xor), then maddubs of |code| against the activations carrying
// the code's sign, as int8_dot (a pair is at most 2 x 128 x 127: no saturation).
inline void int8_tile_dots(const uint8_t* w, const QRow& r, int64_t in, const float* scales, float* y) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < in; b += QK) {
    const uint8_t* wb = w + b * TR;
    __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 8
    for (int k = 0; k < QK / 4; ++k) {
      const __m256i q = broadcast4_256(r.q + b + 4 * k);
      for (int h = 0; h < 2; ++h) {
        const __m256i wv = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * k + 32 * h)), flip);
        const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(q, wv));
        s[h] = _mm256_add_epi32(s[h], _mm256_madd_epi16(p, ones));
      }
    }
    for (int h = 0; h < 2; ++h) acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[h]), _mm256_set1_ps(r.d_lane[b / 4]), acc[h]);
  }
  for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + 8 * h, _mm256_mul_ps(acc[h], _mm256_loadu_ps(scales + 8 * h)));
}

// int4 tile: maddubs has no int32 accumulation, so the high nibbles are shifted down (in place, 16 x code would
// saturate), and a block's products add up in int16: 8 pairs a lane, at most 8 x 2 x 15 x 127 = 30480.
template <typename S>
inline void int4_tile_dots(const uint8_t* w, const S* ws, const S* off, const QRow& r, int64_t in, int64_t group,
                           float* y) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < in / group; ++g) {
    __m256 gacc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = g * group; b < (g + 1) * group; b += QK) {
      const uint8_t* wb = w + b * TR / 2;
      __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        const __m256i qlo = broadcast4_256(r.q + b + 8 * k), qhi = broadcast4_256(r.q + b + 8 * k + 4);
        prefetch_ahead(wb + 64 * k);
        for (int h = 0; h < 2; ++h) {
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * k + 32 * h));
          const __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
          s[h] = _mm256_add_epi16(s[h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, qlo), _mm256_maddubs_epi16(hi, qhi)));
        }
      }
      for (int h = 0; h < 2; ++h)
        gacc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[h], ones)), _mm256_set1_ps(r.d_lane[b / 4]), gacc[h]);
    }
    for (int h = 0; h < 2; ++h) {
      acc[h] = _mm256_fmadd_ps(gacc[h], load8(ws + g * TR + 8 * h), acc[h]);
      acc[h] = _mm256_fmadd_ps(load8(off + g * TR + 8 * h), _mm256_set1_ps(r.group_sum[g]), acc[h]);
    }
  }
  for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + 8 * h, acc[h]);
}

#else
inline float int8_dot(const int8_t* w, const QRow& r, int64_t in) {
  float acc = 0.f;
  for (int64_t b = 0; b < in; b += QK) {
    int32_t s = 0;
    for (int64_t j = b; j < b + QK; ++j) s += static_cast<int32_t>(w[j]) * r.q[j];
    acc += static_cast<float>(s) * r.d_lane[b / 4];
  }
  return acc;
}

inline float int4_dot(const uint8_t* w, const float* ws, const float* off, const QRow& r, int64_t in,
                      int gshift) {
  const int64_t half = in / 2;
  float acc = 0.f;
  for (int64_t b = 0; b < half; b += QK) {
    int32_t lo = 0, hi = 0;
    for (int64_t j = b; j < b + QK; ++j) {
      lo += (w[j] & 15) * r.q[j];
      hi += (w[j] >> 4) * r.q[half + j];
    }
    acc += static_cast<float>(lo) * (r.d_lane[b / 4] * ws[b >> gshift]);
    acc += static_cast<float>(hi) * (r.d_lane[(half + b) / 4] * ws[(half + b) >> gshift]);
  }
  for (int64_t g = 0; g < (in >> gshift); ++g) acc += off[g] * r.group_sum[g];
  return acc;
}

template <int NR>
inline void int4_dots(const uint8_t* w, const float* ws, const float* off, const QRow& r, int64_t in, int gshift,
                      float* out) {
  const int64_t n_groups = in >> gshift;
  for (int k = 0; k < NR; ++k)
    out[k] = int4_dot(w + k * (in / 2), ws + k * n_groups, off + k * n_groups, r, in, gshift);
}
#endif

#if !defined(KVFAST_AVX512)  // AVX2 and plain: int8 rows one after another
template <int NR>
inline void int8_dots(const int8_t* w, int64_t in, const QRow& r, float* out) {
  for (int k = 0; k < NR; ++k) out[k] = int8_dot(w + k * in, r, in);
}
#endif

constexpr int64_t GRAIN = 32;  // output rows per task: a call's few microseconds of parallel overhead
constexpr int NR = 4;         // output rows per inner product (int8_dots / int4_dots)

// The output rows in tiles of NR, split between threads; tile(o, n, r, dots) fills dots[0..n) with output rows
// o..o+n of activation row r (n < NR only at a thread's last tile).
template <typename Tile>
void for_output_tiles(int64_t out, int64_t rows, const Tile& tile) {
  at::parallel_for(0, out, GRAIN, [&](int64_t begin, int64_t end) {
    float dots[NR];
    for (int64_t o = begin; o < end; o += NR) {
      const int n = static_cast<int>(std::min<int64_t>(NR, end - o));
      for (int64_t r = 0; r < rows; ++r) tile(o, n, r, dots);
    }
  });
}

at::Tensor int8_linear(const at::Tensor& x_, const at::Tensor& codes_, const at::Tensor& scales_) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && codes_.scalar_type() == at::kChar, "int8_linear: float x, int8 codes");
  const at::Tensor x = x_.contiguous(), codes = codes_.contiguous(), scales = scales_.to(at::kFloat).contiguous();
  const int64_t in = x.size(-1), out = codes.size(0), rows = x.numel() / in;
  TORCH_CHECK(codes.size(1) == in && in % QK == 0, "int8_linear: in must match and be a multiple of 32");
  const auto q = quantize_rows(x, 0);
  at::Tensor y = output_like(x, out);
  float* yp = y.data_ptr<float>();
  const int8_t* wp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  for_output_tiles(out, rows, [&](int64_t o, int n, int64_t r, float* dots) {
    if (n == NR) {
      int8_dots<NR>(wp + o * in, in, q[r], dots);
    } else {
      for (int k = 0; k < n; ++k) int8_dots<1>(wp + (o + k) * in, in, q[r], dots + k);
    }
    for (int k = 0; k < n; ++k) yp[r * out + o + k] = dots[k] * sp[o + k];
  });
  return y;
}

at::Tensor int4_linear(const at::Tensor& x_, const at::Tensor& packed_, const at::Tensor& scales_,
                       const at::Tensor& offsets_) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && packed_.scalar_type() == at::kByte, "int4_linear: float x, uint8 codes");
  const at::Tensor x = x_.contiguous(), packed = packed_.contiguous();
  const at::Tensor scales = scales_.to(at::kFloat).contiguous(), offsets = offsets_.to(at::kFloat).contiguous();
  const int64_t in = x.size(-1), out = packed.size(0), rows = x.numel() / in, n_groups = scales.size(1);
  const int64_t group = in / n_groups;
  const int gshift = __builtin_ctzll(static_cast<unsigned long long>(group));
  TORCH_CHECK(packed.size(1) * 2 == in && (in / 2) % QK == 0 && group % QK == 0 && n_groups * group == in &&
                  (int64_t{1} << gshift) == group,
              "int4_linear: in / 2 must be a multiple of 32, the group size a power of two from 32");
  const auto q = quantize_rows(x, group);
  at::Tensor y = output_like(x, out);
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  for_output_tiles(out, rows, [&](int64_t o, int n, int64_t r, float* dots) {
    if (n == NR) {
      int4_dots<NR>(wp + o * (in / 2), sp + o * n_groups, op + o * n_groups, q[r], in, gshift, dots);
    } else {
      for (int k = 0; k < n; ++k)
        int4_dots<1>(wp + (o + k) * (in / 2), sp + (o + k) * n_groups, op + (o + k) * n_groups, q[r], in, gshift,
                     dots + k);
    }
    for (int k = 0; k < n; ++k) yp[r * out + o + k] = dots[k];
  });
  return y;
}

#if defined(KVFAST_AVX512) || defined(KVFAST_AVX2)
// The tiles of [out] output rows split between threads; tile(t, r, y) writes the 16 outputs of tile t for
// activation row r to y.
template <typename Tile>
at::Tensor over_tiles(const at::Tensor& x, int64_t out, const QRows& q, const Tile& tile) {
  at::Tensor y = output_like(x, out);
  float* yp = y.data_ptr<float>();
  const int64_t rows = static_cast<int64_t>(q.size());
  at::parallel_for(0, out / TR, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r = 0; r < rows; ++r) tile(t, q[r], yp + r * out + t * TR);
  });
  return y;
}

at::Tensor int8_linear_tiled(const at::Tensor& x_, const at::Tensor& codes_, const at::Tensor& scales_) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && codes_.scalar_type() == at::kChar, "int8_linear_tiled: float x, int8 tiles");
  const at::Tensor x = x_.contiguous(), codes = codes_.contiguous(), scales = scales_.to(at::kFloat).contiguous();
  const int64_t in = x.size(-1), out = codes.size(0);
  TORCH_CHECK(codes.size(1) == in && in % QK == 0 && out % TR == 0,
              "int8_linear_tiled: in must match and be a multiple of 32, out a multiple of 16");
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(codes.data_ptr<int8_t>());
  const float* sp = scales.data_ptr<float>();
  return over_tiles(x, out, quantize_rows(x, 0), [&](int64_t t, const QRow& r, float* y) {
    int8_tile_dots(wp + t * TR * in, r, in, sp + t * TR, y);
  });
}

at::Tensor int4_linear_tiled(const at::Tensor& x_, const at::Tensor& packed_, const at::Tensor& scales_,
                             const at::Tensor& offsets_) {
  TORCH_CHECK(x_.scalar_type() == at::kFloat && packed_.scalar_type() == at::kByte, "int4_linear_tiled: float x, uint8 tiles");
  // float16 scales and offsets (kernels.retile keeps them so where quantize.py made them exact) are read as such
  const bool half = scales_.scalar_type() == at::kHalf && offsets_.scalar_type() == at::kHalf;
  const at::ScalarType stored = half ? at::kHalf : at::kFloat;
  const at::Tensor x = x_.contiguous(), packed = packed_.contiguous();
  const at::Tensor scales = scales_.to(stored).contiguous(), offsets = offsets_.to(stored).contiguous();
  const int64_t in = x.size(-1), out = packed.size(0), n_groups = scales.size(1), group = in / n_groups;
  TORCH_CHECK(packed.size(1) * 2 == in && group % QK == 0 && n_groups * group == in && out % TR == 0,
              "int4_linear_tiled: groups of a multiple of 32 columns, out a multiple of 16");
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const auto product = [&](const auto* sp, const auto* op) {
    return over_tiles(x, out, quantize_rows(x, group), [&](int64_t t, const QRow& r, float* y) {
      int4_tile_dots(wp + t * TR * in / 2, sp + t * TR * n_groups, op + t * TR * n_groups, r, in, group, y);
    });
  };
  return half ? product(scales.data_ptr<at::Half>(), offsets.data_ptr<at::Half>())
              : product(scales.data_ptr<float>(), offsets.data_ptr<float>());
}
#endif

// int4 codes (int4_linear's layout) -> [out, in] weights in fp32 or bfloat16: code * scale + offset in fp32 (as
// kernels.dequantize_int4), rounded once, to nearest even, where bfloat16. One pass over the codes: a prompt's
// dense weight per layer (model.PromptWeight) costs the eager version five passes over fp32 temporaries.
at::Tensor int4_dequantize(const at::Tensor& packed_, const at::Tensor& scales_, const at::Tensor& offsets_,
                           at::ScalarType dtype, bool tiled) {
  TORCH_CHECK(packed_.scalar_type() == at::kByte && (dtype == at::kFloat || dtype == at::kBFloat16),
              "int4_dequantize: uint8 codes to float32 or bfloat16");
  const at::Tensor packed = packed_.contiguous();
  const at::Tensor scales = scales_.to(at::kFloat).contiguous(), offsets = offsets_.to(at::kFloat).contiguous();
  const int64_t out = packed.size(0), half = packed.size(1), in = 2 * half, n_groups = scales.size(1);
  const int64_t group = in / n_groups;
  TORCH_CHECK(n_groups * group == in && (tiled ? out % TR == 0 && group % 8 == 0 : half % group == 0),
              "int4_dequantize: groups must tile each half of a row (or whole tiles of 16 rows)");
  at::Tensor w = at::empty({out, in}, packed.options().dtype(dtype));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(in);
    for (int64_t o = begin; o < end; ++o) {
      const int64_t t = o / TR, lane = o % TR;
      for (int64_t g = 0; g < n_groups; ++g) {
        const int64_t k = tiled ? (t * n_groups + g) * TR + lane : o * n_groups + g;
        const float scale = sp[k], offset = op[k];
        const int64_t first = g * group;
        if (tiled) {  // byte i of a row's 4 in each 64-byte block of 8 columns: column 8c + i low, 8c + 4 + i high
          const uint8_t* bytes = wp + t * TR * half + lane * 4 + first * 8;
          for (int64_t c = first; c < first + group; c += 8, bytes += 64) {
            for (int i = 0; i < 4; ++i) {
              row[c + i] = float(bytes[i] & 15) * scale + offset;
              row[c + 4 + i] = float(bytes[i] >> 4) * scale + offset;
            }
          }
        } else {
          const uint8_t* codes = wp + o * half;
          const int64_t shift = first < half ? 0 : 4, at = first < half ? first : first - half;
          for (int64_t j = 0; j < group; ++j) row[first + j] = float((codes[at + j] >> shift) & 15) * scale + offset;
        }
      }
      if (dtype == at::kFloat) {
        std::copy(row.begin(), row.end(), w.data_ptr<float>() + o * in);
      } else {
        at::BFloat16* dst = w.data_ptr<at::BFloat16>() + o * in;
        for (int64_t j = 0; j < in; ++j) dst[j] = at::BFloat16(row[j]);
      }
    }
  });
  return w;
}

// int8 codes in rows or in tile_int8's tiles -> [out, in] float32 / bfloat16 codes, unscaled and exact (|code| <= 127):
// a prompt's GEMM scales its output rows. One pass over the codes: untiling and converting in torch took three.
at::Tensor int8_dequantize(const at::Tensor& codes_, at::ScalarType dtype, bool tiled) {
  TORCH_CHECK(codes_.scalar_type() == at::kChar && (dtype == at::kFloat || dtype == at::kBFloat16),
              "int8_dequantize: int8 codes to float32 or bfloat16");
  const at::Tensor codes = codes_.contiguous();
  const int64_t out = codes.size(0), in = codes.size(1);
  TORCH_CHECK(!tiled || (out % TR == 0 && in % 4 == 0), "int8_dequantize: tiles are whole 16 rows x 4 columns");
  at::Tensor w = at::empty({out, in}, codes.options().dtype(dtype));
  const int8_t* cp = codes.data_ptr<int8_t>();
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const int64_t t = o / TR, lane = o % TR;
      const auto code = [&](int64_t j) -> float {  // a tile's byte is code + 128: xor 0x80 restores the int8
        return tiled ? static_cast<float>(static_cast<int8_t>(cp[((t * (in / 4) + j / 4) * TR + lane) * 4 + j % 4] ^ 0x80))
                     : static_cast<float>(cp[o * in + j]);
      };
      if (dtype == at::kFloat) {
        float* dst = w.data_ptr<float>() + o * in;
        for (int64_t j = 0; j < in; ++j) dst[j] = code(j);
      } else {
        at::BFloat16* dst = w.data_ptr<at::BFloat16>() + o * in;
        for (int64_t j = 0; j < in; ++j) dst[j] = at::BFloat16(code(j));
      }
    }
  });
  return w;
}

// The activations exactly as the products see them: q [..., in] int8 and the block scales [..., in / 32]
// (tests compare against a float64 product of these).
std::tuple<at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x_) {
  const at::Tensor x = x_.contiguous();
  const int64_t in = x.size(-1), rows = x.numel() / in;
  const auto q = quantize_rows(x, 0);
  auto qs = x.sizes().vec();
  at::Tensor codes = at::empty(qs, x.options().dtype(at::kChar));
  qs.back() = in / QK;
  at::Tensor d = at::empty(qs, x.options());
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(q[r].q, q[r].q + in, codes.data_ptr<int8_t>() + r * in);
    for (int64_t b = 0; b < in / QK; ++b) d.data_ptr<float>()[r * (in / QK) + b] = q[r].d_lane[b * QK / 4];
  }
  return {codes, d};
}


}  // namespace

TORCH_LIBRARY(KVFAST_NS, m) {
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales, Tensor offsets) -> Tensor");
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor)");
  m.def("int4_dequantize(Tensor packed, Tensor scales, Tensor offsets, ScalarType dtype, bool tiled=False) -> Tensor");
  m.def("int8_dequantize(Tensor codes, ScalarType dtype, bool tiled=False) -> Tensor");
#if defined(KVFAST_AVX512) || defined(KVFAST_AVX2)
  m.def("int8_linear_tiled(Tensor x, Tensor codes, Tensor scales) -> Tensor");
  m.def("int4_linear_tiled(Tensor x, Tensor packed, Tensor scales, Tensor offsets) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(KVFAST_NS, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("quantize_activations", &quantize_activations);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("int8_dequantize", &int8_dequantize);
#if defined(KVFAST_AVX512) || defined(KVFAST_AVX2)
  m.impl("int8_linear_tiled", &int8_linear_tiled);
  m.impl("int4_linear_tiled", &int4_linear_tiled);
#endif
}
