// What kernels_cpu.cpp (one-token products) and gemm_cpu.cpp (a prompt's products) share: the Q8_0
// quantization of the activation rows and the tiled layouts' constants.

#pragma once

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVFAST_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define KVFAST_AVX2 1
#endif
#if defined(KVFAST_AVX512) || defined(KVFAST_AVX2)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;  // activation block (Q8_0)
constexpr int64_t TR = 16;  // output rows per tile of the tiled layouts (kernels_cpu.py tile_int8 / tile_int4)

// One activation row quantized for the integer products; lane i (4 columns) carries its block's scale.
struct QRow {
  std::vector<int8_t> q;        // [in]
  std::vector<float> d_lane;    // [in / 4]: the scale of the block of columns 4i..4i+3
  std::vector<int32_t> bias;    // [in / 4]: -128 * (q[4i] + ... + q[4i+3]) (the int8 codes' +128 shift)
  std::vector<float> group_sum; // [n_groups]: sum of the exact x over each weight group (int4's offsets)
  std::vector<int32_t> block_bias;  // [in / 32]: the sum of `bias` over each block of 32 columns (tiled int8)
};

void quantize_row(const float* x, int64_t in, int64_t group, QRow& r) {
  r.q.resize(in);
  r.d_lane.resize(in / 4);
  r.bias.resize(in / 4);
  r.group_sum.assign(group > 0 ? in / group : 0, 0.f);
  r.block_bias.resize(in / QK);
  for (int64_t b = 0; b < in; b += QK) {
#if defined(KVFAST_AVX512)
    const __m512 v0 = _mm512_loadu_ps(x + b), v1 = _mm512_loadu_ps(x + b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    const __m512 vid = _mm512_set1_ps(id);
    // round to nearest even (the default MXCSR mode), as std::nearbyint; |x * id| <= 127, so no saturation
    _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q.data() + b), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vid))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q.data() + b + 16),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vid))));
    _mm256_storeu_ps(r.d_lane.data() + b / 4, _mm256_set1_ps(d));
    const __m256i ones = _mm256_set1_epi8(1);
    const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones,
                                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.q.data() + b)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.bias.data() + b / 4),
                        _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, 7)));
    if (group > 0) r.group_sum[b / group] += _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
#else
    float amax = 0.f;
    for (int64_t j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[b + j]));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    for (int64_t j = 0; j < QK; ++j) r.q[b + j] = static_cast<int8_t>(std::nearbyint(x[b + j] * id));
    for (int64_t l = b / 4; l < (b + QK) / 4; ++l) {
      r.d_lane[l] = d;
      r.bias[l] = -128 * (r.q[4 * l] + r.q[4 * l + 1] + r.q[4 * l + 2] + r.q[4 * l + 3]);
    }
    if (group > 0) {
      float s = 0.f;
      for (int64_t j = 0; j < QK; ++j) s += x[b + j];
      r.group_sum[b / group] += s;
    }
#endif
    int32_t block_bias = 0;
    for (int64_t l = b / 4; l < (b + QK) / 4; ++l) block_bias += r.bias[l];
    r.block_bias[b / QK] = block_bias;
  }
}

#if defined(KVFAST_AVX512)
inline __m512i broadcast4(const int8_t* q) {  // 4 activation codes to every lane
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {  // 16 float16 values, widened exactly
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

#endif

// x [..., in] (float32 or bfloat16) -> its rows quantized, in parallel; y [..., out] like x.
std::vector<QRow> quantize_rows(const at::Tensor& x, int64_t group) {
  TORCH_CHECK(x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quantize_rows: contiguous float32 or bfloat16 rows");
  const int64_t in = x.size(-1), rows = x.numel() / in;
  const bool wide = x.scalar_type() == at::kFloat;
  std::vector<QRow> q(rows);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(wide ? 0 : in);
    for (int64_t r = begin; r < end; ++r) {
      if (wide) {
        quantize_row(x.data_ptr<float>() + r * in, in, group, q[r]);
      } else {
        const at::BFloat16* xr = x.data_ptr<at::BFloat16>() + r * in;
        for (int64_t j = 0; j < in; ++j) row[j] = static_cast<float>(xr[j]);
        quantize_row(row.data(), in, group, q[r]);
      }
    }
  });
  return q;
}

at::Tensor output_like(const at::Tensor& x, int64_t out) {
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  return at::empty(sizes, x.options());
}

}  // namespace
