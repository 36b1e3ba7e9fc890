// What kernels_cpu.cpp (one-token products) and gemm_cpu.cpp (a prompt's products) share: the Q8_0
// quantization of the activation rows and the tiled layouts' constants.

#pragma once

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVFAST_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVFAST_AVX2 1
#endif
#if defined(KVFAST_AVX512) || defined(KVFAST_AVX2)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;  // activation block (Q8_0)
constexpr int64_t TR = 16;  // output rows per tile of the tiled layouts (kernels_cpu.py tile_int8 / tile_int4)

// One activation row quantized for the integer products (a view into QRows); lane i (4 columns) carries its
// block's scale.
struct QRow {
  int8_t* q;            // [in]
  float* d_lane;        // [in / 4]: the scale of the block of columns 4i..4i+3
  int32_t* bias;        // [in / 4]: -128 * (q[4i] + ... + q[4i+3]) (the int8 codes' +128 shift; AVX-512 builds)
  float* group_sum;     // [n_groups]: sum of the exact x over each weight group (int4's offsets)
  int32_t* block_bias;  // [in / 32]: the sum of `bias` over each block of 32 columns (tiled int8; AVX-512 builds)
};

// The quantized rows of one product in one block of memory. A decode step's rows (one token's, up to 64 KB) reuse
// this thread's block unless another QRows holds it: a step quantizes ~150 single rows, and one allocation per
// field cost 0.7 us of a 20 us int4 product at SmolLM2's shapes. A prompt's rows come from the heap, so that no
// thread keeps a long prompt's megabytes.
constexpr size_t QROWS_REUSED_BYTES = 1 << 16;
struct QRowsBlock {
  std::vector<std::byte> bytes;
  bool busy = false;
};
thread_local QRowsBlock qrows_block;

class QRows {
 public:
  QRows(int64_t rows, int64_t in, int64_t n_groups) : rows_(rows) {
    const size_t words = static_cast<size_t>(rows * (in / 4 * 2 + n_groups + in / 32)),
                 bytes = rows * sizeof(QRow) + words * 4 + rows * in;
    std::byte* base;
    if (bytes <= QROWS_REUSED_BYTES && !qrows_block.busy) {
      if (qrows_block.bytes.size() < bytes) qrows_block.bytes.resize(QROWS_REUSED_BYTES);
      qrows_block.busy = owns_block_ = true;
      base = qrows_block.bytes.data();
    } else {
      heap_.reset(new std::byte[bytes]);
      base = heap_.get();
    }
    QRow* row = reinterpret_cast<QRow*>(base);
    float* d_lane = reinterpret_cast<float*>(base + rows * sizeof(QRow));
    int32_t* bias = reinterpret_cast<int32_t*>(d_lane + rows * in / 4);
    float* group_sum = reinterpret_cast<float*>(bias + rows * in / 4);
    int32_t* block_bias = reinterpret_cast<int32_t*>(group_sum + rows * n_groups);
    int8_t* q = reinterpret_cast<int8_t*>(block_bias + rows * in / 32);
    std::fill(group_sum, group_sum + rows * n_groups, 0.f);  // quantize_row adds each block's sum
    for (int64_t r = 0; r < rows; ++r)
      row[r] = {q + r * in, d_lane + r * in / 4, bias + r * in / 4, group_sum + r * n_groups, block_bias + r * in / 32};
    rows_ptr_ = row;
  }
  QRows(QRows&& other) noexcept
      : heap_(std::move(other.heap_)), rows_ptr_(other.rows_ptr_), rows_(other.rows_), owns_block_(other.owns_block_) {
    other.owns_block_ = false;
  }
  QRows& operator=(QRows&&) = delete;
  ~QRows() {
    if (owns_block_) qrows_block.busy = false;
  }
  const QRow& operator[](int64_t r) const { return rows_ptr_[r]; }
  int64_t size() const { return rows_; }

 private:
  std::unique_ptr<std::byte[]> heap_;
  QRow* rows_ptr_ = nullptr;
  int64_t rows_;
  bool owns_block_ = false;
};

#if defined(KVFAST_AVX2)
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// 8 values widened to fp32, exactly: int4 scales (float32 / float16), K and V rows (also bfloat16)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

#if defined(KVFAST_AVX512)
// 16 values widened to fp32, exactly: activation rows (float32 / bfloat16), int4 scales (float32 / float16), K
// and V rows
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

// x [in] (float32; bfloat16 in the vector builds) into r, whose group sums start at zero.
template <typename T>
void quantize_row(const T* x, int64_t in, int64_t group, const QRow& r) {
  for (int64_t b = 0; b < in; b += QK) {
#if defined(KVFAST_AVX512)
    const __m512 v0 = load16(x + b), v1 = load16(x + b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    const __m512 vid = _mm512_set1_ps(id);
    // round to nearest even (the default MXCSR mode), as std::nearbyint; |x * id| <= 127, so no saturation
    _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q + b), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vid))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q + b + 16),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vid))));
    _mm256_storeu_ps(r.d_lane + b / 4, _mm256_set1_ps(d));
    const __m256i ones = _mm256_set1_epi8(1);
    const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones,
                                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.q + b)));
    const __m256i bias = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.bias + b / 4), bias);
    r.block_bias[b / QK] = _mm512_reduce_add_epi32(_mm512_inserti64x4(_mm512_setzero_si512(), bias, 0));
    if (group > 0) r.group_sum[b / group] += _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
#elif defined(KVFAST_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(x + b + 8 * i);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float d = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));  // as nearbyint
    // the packs work within 128-bit lanes: words 0-3 of q0, q1, q2, q3, then their 4-7, put back in order
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q + b),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    _mm256_storeu_ps(r.d_lane + b / 4, _mm256_set1_ps(d));
    if (group > 0) r.group_sum[b / group] += hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
#else
    float amax = 0.f;
    for (int64_t j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[b + j]));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    for (int64_t j = 0; j < QK; ++j) r.q[b + j] = static_cast<int8_t>(std::nearbyint(x[b + j] * id));
    for (int64_t l = b / 4; l < (b + QK) / 4; ++l) r.d_lane[l] = d;
    if (group > 0) {
      float s = 0.f;
      for (int64_t j = 0; j < QK; ++j) s += x[b + j];
      r.group_sum[b / group] += s;
    }
#endif
  }
}

#if defined(KVFAST_AVX2)
inline __m256i broadcast4_256(const int8_t* q) {  // 4 activation codes to every lane
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm256_set1_epi32(v);
}
#endif
#if defined(KVFAST_AVX512)
inline __m512i broadcast4(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return _mm512_set1_epi32(v);
}
#endif

// x [..., in] (float32 or bfloat16) -> its rows quantized, in parallel; y [..., out] like x.
QRows quantize_rows(const at::Tensor& x, int64_t group) {
  TORCH_CHECK(x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quantize_rows: contiguous float32 or bfloat16 rows");
  const int64_t in = x.size(-1), rows = x.numel() / in;
  const bool wide = x.scalar_type() == at::kFloat;
  QRows q(rows, in, group > 0 ? in / group : 0);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
#if !defined(KVFAST_AVX2)
    std::vector<float> row(wide ? 0 : in);
#endif
    for (int64_t r = begin; r < end; ++r) {
      if (wide) {
        quantize_row(x.data_ptr<float>() + r * in, in, group, q[r]);
        continue;
      }
      const at::BFloat16* xr = x.data_ptr<at::BFloat16>() + r * in;
#if defined(KVFAST_AVX2)
      quantize_row(xr, in, group, q[r]);
#else
      for (int64_t j = 0; j < in; ++j) row[j] = static_cast<float>(xr[j]);
      quantize_row(row.data(), in, group, q[r]);
#endif
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
