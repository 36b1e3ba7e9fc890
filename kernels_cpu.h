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

#if defined(KVFAST_AVX2)
// ---- one vector of fp32 lanes: 16 (AVX-512) or 8 (AVX2) ----------------------------------------------------------
// What the one-query attention and the prompt's GEMM need of it, so that one kernel serves both builds. `heads`:
// the query heads whose scores of four keys the one-query kernel keeps in registers at once; `values`: the
// accumulators its values' product keeps in registers (32 or 16 registers in all).
template <typename T> constexpr bool is_bf16 = std::is_same_v<T, at::BFloat16>;

struct Avx2 {
  using reg = __m256;
  static constexpr int W = 8, heads = 3, values = 12;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg fnmadd(reg a, reg b, reg c) { return _mm256_fnmadd_ps(a, b, c); }
  static reg nearest(reg x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static reg times_pow2(reg y, reg n) {  // y 2^n for integral -126 <= n <= 127: the exponent built by a shift
    return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)));
  }
  static reg finite_or_zero(reg x, reg y) {  // y where x > -inf, else 0
    return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ), y);
  }
  static reg loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static void storeu(at::BFloat16* p, reg x) {  // rounded to nearest even (as at::BFloat16; no NaN)
    const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(round<at::BFloat16>(x)), 16);
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0x08);  // 8 in order
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(words));
  }
  static __m256i first(int64_t n) {  // lanes [0, n) set
    static const int32_t ones[2 * W] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ones + W - std::min<int64_t>(n, W)));
  }
  static reg load_first(const float* p, int64_t n, float fill) {  // lanes [0, n) of p, the rest `fill`
    if (n >= W) return loadu(p);
    const __m256i live = first(n);
    return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, live), _mm256_castsi256_ps(live));
  }
  static void store_first(float* p, reg x, int64_t n) {
    if (n >= W) storeu(p, x);
    else _mm256_maskstore_ps(p, first(n), x);
  }
  static float reduce_add(reg x) { return hsum8(x); }
  static float reduce_max(reg x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static __m128 sum4(reg a, reg b, reg c, reg d) {  // the sums of the lanes of a, b, c and d, in that order
    const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  }
  // W channels of a K or V row as fp32; and, for bfloat16 K/V, fp32 rounded to bfloat16 and back at the points
  // where attend's bfloat16 matmuls round (kernels.attend_one_query rounds alike; fp16 K/V are read exactly)
  template <typename T> static reg load(const T* p) { return load8(p); }
  template <typename T> static reg round(reg x) {
    if constexpr (!is_bf16<T>) return x;
    const __m256i b = _mm256_castps_si256(x);  // to nearest even (finite x; -inf stays -inf)
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};

#if defined(KVFAST_AVX512)
struct Avx512 {
  using reg = __m512;
  static constexpr int W = 16, heads = 4, values = 28;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg fnmadd(reg a, reg b, reg c) { return _mm512_fnmadd_ps(a, b, c); }
  static reg nearest(reg x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT); }
  static reg times_pow2(reg y, reg n) { return _mm512_scalef_ps(y, n); }
  static reg finite_or_zero(reg x, reg y) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ), y);
  }
  static reg loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static void storeu(at::BFloat16* p, reg x) {
    const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(round<at::BFloat16>(x)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
  }
  static __mmask16 first(int64_t n) { return n >= W ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }
  static reg load_first(const float* p, int64_t n, float fill) { return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), first(n), p); }
  static void store_first(float* p, reg x, int64_t n) { _mm512_mask_storeu_ps(p, first(n), x); }
  static float reduce_add(reg x) { return _mm512_reduce_add_ps(x); }
  static float reduce_max(reg x) { return _mm512_reduce_max_ps(x); }
  static __m128 sum4(reg a, reg b, reg c, reg d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));  // a b c d per 128
    const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
    return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
  }
  template <typename T> static reg load(const T* p) { return load16(p); }
  template <typename T> static reg round(reg x) {
    if constexpr (!is_bf16<T>) return x;
    const __m512i b = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};
using Vec = Avx512;
#else
using Vec = Avx2;
#endif
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
