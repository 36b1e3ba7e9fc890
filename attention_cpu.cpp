// Attention kernels for CPU, built with kernels_cpu.cpp, whose TORCH_LIBRARY this fragment adds its ops to: a
// compiled decode step's one-query attention (AVX-512 and AVX2 builds) and a prompt's causal attention in bfloat16
// (AVX-512 builds).

#include "kernels_cpu.h"

#include <algorithm>
#include <bit>
#include <memory>
#include <utility>

#if defined(KVFAST_AVX2)
namespace {


// e^x for x <= 0 (a softmax's shifted scores): x = n ln2 + r, e^r by Cephes' degree-6 polynomial, times 2^n.
template <class V> inline typename V::reg exp_of(typename V::reg x) {
  x = V::max(x, V::set1(-87.f));
  const typename V::reg n = V::nearest(V::mul(x, V::set1(1.44269504088896341f)));
  typename V::reg r = V::fnmadd(n, V::set1(0.693359375f), x);
  r = V::fnmadd(n, V::set1(-2.12194440e-4f), r);
  typename V::reg y = V::set1(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = V::fmadd(y, r, V::set1(c));
  y = V::fmadd(y, V::mul(r, r), V::add(r, V::set1(1.f)));
  return V::times_pow2(y, n);
}

// f(integral_constant<int, 0>), f(integral_constant<int, step>), ... below `end`
template <int end, int step, typename F> inline void for_steps(F&& f) {
  [&]<int... i>(std::integer_sequence<int, i...>) {
    (f(std::integral_constant<int, i * step>{}), ...);
  }(std::make_integer_sequence<int, (end + step - 1) / step>{});
}

// ---- one-query attention (a decode step's attention over the cache) -------------------------------------------
// Inductor's reductions for it read each key once per query head of its group and run at a quarter of the
// bandwidth; here the g query heads of a KV head share every load of K and V, masked slots are not read at all,
// and the keys are split in blocks between threads (flash-decoding: each block's max and sum, combined).
#ifndef KV_AHEAD
#define KV_AHEAD 2048
#endif
// A step reads each K and V row once, in order, from memory: fetched KV_AHEAD bytes ahead, also across the 4 KB
// pages where the hardware's stream stops (from memory, not cache, the kernel ran at 7 GB/s a thread without)
template <typename T> inline void prefetch_row_ahead(const T* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row) + KV_AHEAD;
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}
constexpr int64_t KEY_BLOCK = 128;  // keys per task: a 512-slot cache of 3 KV heads is 12 tasks for 2 threads

#if defined(KVFAST_AVX512)
// The one-query and the prompt kernels below are compiled for AVX512-BF16; the one-query kernel runs its bfloat16
// instructions only where dot is set (bfloat16 K/V on a CPU that has them), and GCC emits them for nothing but
// their intrinsics, so its other instantiations run on any AVX-512 CPU.
#pragma GCC push_options
#pragma GCC target("avx512bf16")
#endif

// q [B, n_kv, g, D] fp32; k, v [B, n_kv, T, D] (fp32 / fp16 / bf16); mask [B, n_kv, T] bool (True: attend) or
// int64 (the slots' positions: attend where >= 0); scale > 0. Returns out [B, n_kv, g, D] fp32 and the
// probabilities [B, n_kv, g, T] fp32 (0 at masked slots). g and nd (D / V::W) are template parameters, so the
// scores' accumulators (four keys of up to V::heads heads) are registers, and one exp a key and head serves both
// the block's sum and the probability. dot (bfloat16 K/V on AVX512-BF16): both products on vdpbf16ps, two
// channels (q . k) or two keys (p v) a lane, with the same roundings: half the multiply-adds, but about 1.1x, not
// 2x, since the sums' reductions and the softmax weigh as much (docs/speed.md).
template <class V, typename T, int g, int nd, bool dot = false>
void one_query_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                              float scale, at::Tensor& out, at::Tensor& probs) {
  using reg = typename V::reg;
  constexpr int W = V::W;
  const int64_t BH = q.size(0) * q.size(1), D = W * nd, Tn = k.size(2);
  const int64_t blocks = (Tn + KEY_BLOCK - 1) / KEY_BLOCK;
  const float* qp = q.data_ptr<float>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  // the mask as bool (true: attend), or as the slots' positions (attend where >= 0), so that a compiled step
  // need not build a bool mask (Inductor stores one at 2-3 ns a slot, 15 us a layer at 6,000 slots); each task
  // tests its block's positions once, in the first pass, into from_positions, which the second pass reads
  const int64_t* pos = mask.scalar_type() == at::kLong ? mask.data_ptr<int64_t>() : nullptr;
  std::unique_ptr<bool[]> from_positions(pos ? new bool[BH * Tn] : nullptr);
  const bool* live = pos ? from_positions.get() : mask.data_ptr<bool>();
  float* pp = probs.data_ptr<float>();
  // part: each task's share of probabilities x V, which every task writes in full (not zeroed first: 0.9 MB a
  // call for 2 KV heads of 7 at 32k slots)
  std::vector<float> bmax(BH * blocks * g), bsum(BH * blocks * g);
  const std::unique_ptr<float[]> part(new float[BH * blocks * g * D]);
  const float minus_inf = -std::numeric_limits<float>::infinity();
  // scores (rounded, scaled, masked) into probs, each block's max and sum of exponentials
  at::parallel_for(0, BH * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, t0 = (task % blocks) * KEY_BLOCK, t1 = std::min(Tn, t0 + KEY_BLOCK);
      if (pos)
        for (int64_t t = t0; t < t1; ++t) from_positions[bh * Tn + t] = pos[bh * Tn + t] >= 0;
      reg qv[g][nd];
      for (int j = 0; j < g; ++j)
        for (int c = 0; c < nd; ++c) qv[j][c] = V::template round<T>(V::loadu(qp + (bh * g + j) * D + W * c));
#if defined(KVFAST_AVX512)
      __m512bh qb[g][nd / 2];  // dot: the rounded query, 32 channels a register
      if constexpr (dot)
        for (int j = 0; j < g; ++j)
          for (int c = 0; c < nd / 2; ++c) qb[j][c] = _mm512_cvtne2ps_pbh(qv[j][2 * c + 1], qv[j][2 * c]);
#endif
      // four keys at a time: their four sums per head come out of one transposing reduction
      for (int64_t t = t0; t < t1; t += 4) {
        const int n = static_cast<int>(std::min<int64_t>(4, t1 - t));
        const bool* mt = live + bh * Tn + t;
        if (!(mt[0] || (n > 1 && mt[1]) || (n > 2 && mt[2]) || (n > 3 && mt[3]))) {
          for (int j = 0; j < g; ++j)
            for (int i = 0; i < n; ++i) pp[(bh * g + j) * Tn + t + i] = minus_inf;
          continue;
        }
        // V::heads heads at a time, so that their accumulators stay registers (Qwen2.5-0.5B's 7 heads at once
        // spill); always four keys (past t1 the last key again, its sum dropped), for the same reason
        for_steps<g, V::heads>([&](auto first) {
          constexpr int j0 = decltype(first)::value, jn = std::min(V::heads, g - j0);
          reg acc[jn][4];
          for (int j = 0; j < jn; ++j)
            for (int i = 0; i < 4; ++i) acc[j][i] = V::zero();
          for (int i = 0; i < 4; ++i) {
            const T* kt = kp + (bh * Tn + std::min<int64_t>(t + i, t1 - 1)) * D;
            if constexpr (j0 == 0) prefetch_row_ahead(kt, D);
#if defined(KVFAST_AVX512)
            if constexpr (dot) {
              for (int c = 0; c < nd / 2; ++c) {
                const __m512bh kc = (__m512bh)_mm512_loadu_si512(kt + 32 * c);
                for (int j = 0; j < jn; ++j) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], qb[j0 + j][c], kc);
              }
              continue;
            }
#endif
            for (int c = 0; c < nd; ++c) {
              const reg kc = V::load(kt + W * c);
              for (int j = 0; j < jn; ++j) acc[j][i] = V::fmadd(qv[j0 + j][c], kc, acc[j][i]);
            }
          }
          for (int j = 0; j < jn; ++j) {
            const __m128 sums = V::sum4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
            float* dst = pp + (bh * g + j0 + j) * Tn + t;
            if (n == 4) {
              _mm_storeu_ps(dst, sums);
            } else {
              alignas(16) float tmp[4];
              _mm_store_ps(tmp, sums);
              for (int i = 0; i < n; ++i) dst[i] = tmp[i];
            }
            for (int i = 0; i < n; ++i)
              if (!mt[i]) dst[i] = minus_inf;
          }
        });
      }
      for (int j = 0; j < g; ++j) {
        float* s = pp + (bh * g + j) * Tn;
        reg m = V::set1(minus_inf);
        for (int64_t t = t0; t < t1; t += W) {  // a masked score stays -inf (scale > 0)
          const reg x = V::mul(V::template round<T>(V::load_first(s + t, t1 - t, minus_inf)), V::set1(scale));
          V::store_first(s + t, x, t1 - t);
          m = V::max(m, x);
        }
        const float mx = V::reduce_max(m);
        reg sum = V::zero();
        for (int64_t t = t0; t < t1; t += W) {  // e^(score - block max) in place (0 where masked), and their sum
          const reg x = V::load_first(s + t, t1 - t, minus_inf);
          const reg e = V::finite_or_zero(x, exp_of<V>(V::sub(x, V::set1(mx))));
          V::store_first(s + t, e, t1 - t);
          sum = V::add(sum, e);
        }
        bmax[(bh * blocks + task % blocks) * g + j] = mx;
        bsum[(bh * blocks + task % blocks) * g + j] = V::reduce_add(sum);
      }
    }
  });
  // the softmax's max and sum per query head, from its blocks'
  std::vector<float> M(BH * g, minus_inf), L(BH * g, 0.f);
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t b = 0; b < blocks; ++b)
      for (int j = 0; j < g; ++j) M[bh * g + j] = std::max(M[bh * g + j], bmax[(bh * blocks + b) * g + j]);
  for (int64_t bh = 0; bh < BH; ++bh)
    for (int64_t b = 0; b < blocks; ++b)
      for (int j = 0; j < g; ++j) {
        const float m = bmax[(bh * blocks + b) * g + j];
        if (m != minus_inf) L[bh * g + j] += bsum[(bh * blocks + b) * g + j] * std::exp(m - M[bh * g + j]);
      }
  // the probabilities, and each block's share of probabilities x V
  at::parallel_for(0, BH * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, t0 = (task % blocks) * KEY_BLOCK, t1 = std::min(Tn, t0 + KEY_BLOCK);
      alignas(64) float rounded[g][KEY_BLOCK];  // the probabilities as the values' product sees them
      for (int j = 0; j < g; ++j) {
        float* s = pp + (bh * g + j) * Tn;
        const float m = bmax[task * g + j];  // the block's e^(score - m) become e^(score - M) / L by one product
        const reg factor = V::set1(m == minus_inf ? 0.f : std::exp(m - M[bh * g + j]) / L[bh * g + j]);
        for (int64_t t = t0; t < t1; t += W) {
          const reg p = V::mul(V::load_first(s + t, t1 - t, 0.f), factor);
          V::store_first(s + t, p, t1 - t);
          V::store_first(rounded[j] + (t - t0), V::template round<T>(p), t1 - t);
        }
      }
      float* dst = part.get() + task * g * D;
#if defined(KVFAST_AVX512)
      if constexpr (dot) {
        // keys t and t + 1 a step: their values interleaved channel by channel (per 128-bit lane: acc[j][2c] gets
        // channels 8L..8L+3 of the 32 at 32c, acc[j][2c + 1] 8L+4..8L+7), their probabilities a pair per lane.
        // A masked key's value is not read (zeros instead), as below
        __m512 acc[g][nd];
        for (int j = 0; j < g; ++j)
          for (int c = 0; c < nd; ++c) acc[j][c] = _mm512_setzero_ps();
        for (int64_t t = t0; t < t1; t += 2) {
          const bool a = live[bh * Tn + t], b = t + 1 < t1 && live[bh * Tn + t + 1];
          if (!(a || b)) continue;
          const T* vt = vp + (bh * Tn + t) * D;
          prefetch_row_ahead(vt, 2 * D);
          __m512bh p[g];
          for (int j = 0; j < g; ++j) {  // the rounded probabilities are bfloat16 values: their top halves
            uint32_t lo, hi = 0;
            std::memcpy(&lo, &rounded[j][t - t0], 4);
            if (b) std::memcpy(&hi, &rounded[j][t + 1 - t0], 4);
            p[j] = (__m512bh)_mm512_set1_epi32(static_cast<int>((lo >> 16) | (hi & 0xFFFF0000u)));
          }
          for (int c = 0; c < nd / 2; ++c) {
            const __m512i x = _mm512_maskz_loadu_epi16(a ? ~0u : 0u, vt + 32 * c);
            const __m512i y = _mm512_maskz_loadu_epi16(b ? ~0u : 0u, vt + D + 32 * c);
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y), hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
            for (int j = 0; j < g; ++j) {
              acc[j][2 * c] = _mm512_dpbf16_ps(acc[j][2 * c], lo, p[j]);
              acc[j][2 * c + 1] = _mm512_dpbf16_ps(acc[j][2 * c + 1], hi, p[j]);
            }
          }
        }
        const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        for (int j = 0; j < g; ++j)
          for (int c = 0; c < nd / 2; ++c) {
            _mm512_storeu_ps(dst + j * D + 32 * c, _mm512_permutex2var_ps(acc[j][2 * c], first, acc[j][2 * c + 1]));
            _mm512_storeu_ps(dst + j * D + 32 * c + 16, _mm512_permutex2var_ps(acc[j][2 * c], second, acc[j][2 * c + 1]));
          }
        continue;
      }
#endif
      // cb channel vectors of every head at a time: as many accumulators as stay registers (a pass over the
      // block's values for each cb; they are in L1 after the first)
      constexpr int cb = std::min(nd, static_cast<int>(std::bit_floor(static_cast<unsigned>(std::max(1, V::values / g)))));
      for (int c0 = 0; c0 < nd; c0 += cb) {
        reg acc[g][cb];
        for (int j = 0; j < g; ++j)
          for (int c = 0; c < cb; ++c) acc[j][c] = V::zero();
        for (int64_t t = t0; t < t1; ++t) {
          if (!live[bh * Tn + t]) continue;
          const T* vt = vp + (bh * Tn + t) * D + W * c0;
          if (c0 == 0) prefetch_row_ahead(vt, D);
          reg p[g];
          for (int j = 0; j < g; ++j) p[j] = V::set1(rounded[j][t - t0]);
          for (int c = 0; c < cb; ++c) {
            const reg vc = V::load(vt + W * c);
            for (int j = 0; j < g; ++j) acc[j][c] = V::fmadd(p[j], vc, acc[j][c]);
          }
        }
        for (int j = 0; j < g; ++j)
          for (int c = 0; c < cb; ++c) V::storeu(dst + j * D + W * (c0 + c), acc[j][c]);
      }
    }
  });
  // each query head's output, its blocks' shares summed: in parallel where they are many (long contexts)
  float* op = out.data_ptr<float>();
  at::parallel_for(0, BH * g, (32768 + blocks * D - 1) / (blocks * D), [&](int64_t begin, int64_t end) {
    for (int64_t head = begin; head < end; ++head) {
      const int64_t bh = head / g, j = head % g;
      for (int c = 0; c < nd; ++c) {
        reg o = V::zero();
        for (int64_t b = 0; b < blocks; ++b) o = V::add(o, V::loadu(part.get() + ((bh * blocks + b) * g + j) * D + W * c));
        V::storeu(op + head * D + W * c, V::template round<T>(o));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> one_query_attention(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                                       const at::Tensor& mask_, double scale) {
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous(), mask = mask_.contiguous();
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.scalar_type() == at::kFloat &&
                  k.scalar_type() == v.scalar_type() &&
                  (mask.scalar_type() == at::kBool || mask.scalar_type() == at::kLong),
              "one_query_attention: q [B, n_kv, g, D] float32, k and v [B, n_kv, T, D] alike, mask [B, n_kv, T] bool or int64");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3) && q.size(2) >= 1 &&
                  q.size(2) <= 8 && (q.size(3) == 64 || q.size(3) == 128) && mask.numel() == k.size(0) * k.size(1) * k.size(2),
              "one_query_attention: shapes must agree, 1 <= g <= 8, D 64 or 128");
  TORCH_CHECK(scale > 0, "one_query_attention: scale must be positive");
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor probs = at::empty({q.size(0), q.size(1), q.size(2), k.size(2)}, q.options());
  const int64_t g = q.size(2);
#if defined(KVFAST_AVX512)
  static const bool bf16_dot = __builtin_cpu_supports("avx512bf16");
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k.scalar_type(), "one_query_attention", [&] {
    using T = std::conditional_t<std::is_same_v<scalar_t, double>, float, scalar_t>;
    TORCH_CHECK((!std::is_same_v<scalar_t, double>), "one_query_attention: K/V in float32, float16 or bfloat16");
    const auto run = [&](auto G, auto ND) {
      constexpr int gv = decltype(G)::value, ndv = decltype(ND)::value;
#if defined(KVFAST_AVX512)
      if constexpr (is_bf16<T>)
        if (bf16_dot) return one_query_attention_impl<Vec, T, gv, ndv, true>(q, k, v, mask, static_cast<float>(scale), out, probs);
#endif
      one_query_attention_impl<Vec, T, gv, ndv>(q, k, v, mask, static_cast<float>(scale), out, probs);
    };
    const auto with_g = [&](auto ND) {
      switch (g) {
        case 1: run(std::integral_constant<int, 1>{}, ND); break;
        case 2: run(std::integral_constant<int, 2>{}, ND); break;
        case 3: run(std::integral_constant<int, 3>{}, ND); break;
        case 4: run(std::integral_constant<int, 4>{}, ND); break;
        case 5: run(std::integral_constant<int, 5>{}, ND); break;
        case 6: run(std::integral_constant<int, 6>{}, ND); break;
        case 7: run(std::integral_constant<int, 7>{}, ND); break;
        default: run(std::integral_constant<int, 8>{}, ND); break;
      }
    };
    if (q.size(3) == 64) with_g(std::integral_constant<int, 64 / Vec::W>{});
    else with_g(std::integral_constant<int, 128 / Vec::W>{});
  });
  return {out, probs};
}

#if defined(KVFAST_AVX512)
// ---- causal attention over a whole prompt in bfloat16 (AVX512-BF16) -------------------------------------------
// Without AMX, ATen's CPU flash attention multiplies bfloat16 at fp32's speed (42 ms per SmolLM2 layer at 2048
// tokens on an AMD EPYC, half of the prefill). Here both products run on vdpbf16ps: K is packed with 16 keys side
// by side (lane = key, a pair of channels per dword) and V with 16 channels side by side (a pair of keys per
// dword); each query row's channel pairs, and its probabilities' key pairs, are broadcast. The softmax is online
// (a running max and sum per row, in fp32); the probabilities are rounded to bfloat16 for V's product, as ATen's
// flash attention rounds them. Rows of PR queries share each load of K and V.
constexpr int64_t PQ = 16;  // query positions per task (of every head of the group)
constexpr int PR = 4;       // query rows sharing each load of K and V
constexpr int64_t PK = 32;  // keys per step of the online softmax

inline __m512bh bf16x32(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh pair_of(const uint16_t* p) {  // two bfloat16 values, broadcast to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

template <int D>
void prompt_attention_impl(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t B,
                           int64_t Hkv, int64_t g, int64_t S, float scale) {
  constexpr int P = D / 2, NC = D / 16;
  const int64_t SK = (S + PK - 1) / PK * PK;  // keys padded with zeros to whole steps (masked)
  // K: [B * Hkv][SK / 16][P][16 keys][2 channels]; V: [B * Hkv][SK / 2][NC][16 channels][2 keys]
  std::vector<uint16_t> kp(B * Hkv * SK * D, 0), vp(B * Hkv * SK * D, 0);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t bh = b0; bh < b1; ++bh) {
      uint16_t* kd = kp.data() + bh * SK * D;
      uint16_t* vd = vp.data() + bh * SK * D;
      for (int64_t t = 0; t < S; ++t) {
        const uint16_t* ks = k + (bh * S + t) * D;
        const uint16_t* vs = v + (bh * S + t) * D;
        for (int d = 0; d < D; ++d) {
          kd[(((t / 16) * P + d / 2) * 16 + t % 16) * 2 + d % 2] = ks[d];
          vd[(((t / 2) * NC + d / 16) * 16 + d % 16) * 2 + t % 2] = vs[d];
        }
      }
    }
  });
  const int64_t nq = (S + PQ - 1) / PQ;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * Hkv * nq, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) uint16_t probs[PR][PK];
    for (int64_t i = i0; i < i1; ++i) {
      // query blocks alternate between the first (few keys) and the last (many): each thread's range is balanced
      const int64_t bh = i / nq, j = i % nq, qb = j % 2 == 0 ? j / 2 : nq - 1 - j / 2;
      const uint16_t* kb = kp.data() + bh * SK * D;
      const uint16_t* vb = vp.data() + bh * SK * D;
      for (int64_t h = 0; h < g; ++h) {
        const int64_t head = bh * g + h;  // b * H + kv_head * g + h
        for (int64_t r0 = qb * PQ; r0 < std::min(S, (qb + 1) * PQ); r0 += PR) {
          const int rows = static_cast<int>(std::min<int64_t>(PR, S - r0));
          const uint16_t* qrow[PR];
          __m512 acc[PR][NC];
          float m[PR], l[PR];
          for (int r = 0; r < PR; ++r) {
            qrow[r] = q + (head * S + r0 + std::min(r, rows - 1)) * D;
            m[r] = minus_inf;
            l[r] = 0.f;
            for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
          }
          for (int64_t t0 = 0; t0 < r0 + rows; t0 += PK) {
            __m512 s[PR][2];
            for (int r = 0; r < PR; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
            const uint16_t* kt = kb + (t0 / 16) * P * 32;
#pragma GCC unroll 8
            for (int p = 0; p < P; ++p) {
              const __m512bh k0 = bf16x32(kt + p * 32), k1 = bf16x32(kt + (P + p) * 32);
              for (int r = 0; r < PR; ++r) {
                const __m512bh qq = pair_of(qrow[r] + 2 * p);
                s[r][0] = _mm512_dpbf16_ps(s[r][0], k0, qq);
                s[r][1] = _mm512_dpbf16_ps(s[r][1], k1, qq);
              }
            }
            for (int r = 0; r < PR; ++r) {
              const int64_t pos = r0 + r;  // keys t0 + lane <= pos are seen
              const int64_t n0 = std::clamp<int64_t>(pos - t0 + 1, 0, 16), n1 = std::clamp<int64_t>(pos - t0 - 15, 0, 16);
              const __mmask16 live0 = static_cast<__mmask16>((1u << n0) - 1), live1 = static_cast<__mmask16>((1u << n1) - 1);
              const __m512 x0 = _mm512_mask_blend_ps(live0, _mm512_set1_ps(minus_inf), _mm512_mul_ps(s[r][0], _mm512_set1_ps(scale)));
              const __m512 x1 = _mm512_mask_blend_ps(live1, _mm512_set1_ps(minus_inf), _mm512_mul_ps(s[r][1], _mm512_set1_ps(scale)));
              const float mx = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(x0, x1)));
              const float alpha = n0 == 0 ? 1.f : std::exp(m[r] - mx);
              const __m512 p0 = _mm512_maskz_mov_ps(live0, exp_of<Avx512>(_mm512_sub_ps(x0, _mm512_set1_ps(mx))));
              const __m512 p1 = _mm512_maskz_mov_ps(live1, exp_of<Avx512>(_mm512_sub_ps(x1, _mm512_set1_ps(mx))));
              if (n0 > 0) {
                m[r] = mx;
                l[r] = l[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
                for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], _mm512_set1_ps(alpha));
              }
              _mm512_store_si512(probs[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
            }
            const uint16_t* vt = vb + (t0 / 2) * NC * 32;
#pragma GCC unroll 4
            for (int jp = 0; jp < PK / 2; ++jp) {
              __m512bh vv[NC];
              for (int c = 0; c < NC; ++c) vv[c] = bf16x32(vt + (jp * NC + c) * 32);
              for (int r = 0; r < PR; ++r) {
                const __m512bh pp = pair_of(probs[r] + 2 * jp);
                for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], pp);
              }
            }
          }
          for (int r = 0; r < rows; ++r) {
            uint16_t* dst = out + (head * S + r0 + r) * D;
            const __m512 inv = _mm512_set1_ps(1.f / l[r]);
            for (int c = 0; c < NC; ++c)
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c),
                                  (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv)));
          }
        }
      }
    }
  });
}
#pragma GCC pop_options

at::Tensor prompt_attention(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, double scale) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "prompt_attention: this CPU has no AVX512-BF16");
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.scalar_type() == at::kBFloat16 &&
                  k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "prompt_attention: q [B, H, S, D], k and v [B, H_kv, S, D], all bfloat16");
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3), Hkv = k.size(1);
  TORCH_CHECK(k.size(0) == B && k.size(2) == S && k.size(3) == D && Hkv > 0 && H % Hkv == 0 && (D == 64 || D == 128),
              "prompt_attention: shapes must agree, H a multiple of H_kv, D 64 or 128");
  at::Tensor out = at::empty(q.sizes(), q.options());
  const auto ptr = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
  if (D == 64)
    prompt_attention_impl<64>(ptr(q), ptr(k), ptr(v), ptr(out), B, Hkv, H / Hkv, S, static_cast<float>(scale));
  else
    prompt_attention_impl<128>(ptr(q), ptr(k), ptr(v), ptr(out), B, Hkv, H / Hkv, S, static_cast<float>(scale));
  return out;
}

#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(KVFAST_NS, m) {
  m.def("one_query_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> (Tensor, Tensor)");
#if defined(KVFAST_AVX512)
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(KVFAST_NS, CPU, m) {
  m.impl("one_query_attention", &one_query_attention);
#if defined(KVFAST_AVX512)
  m.impl("prompt_attention", &prompt_attention);
#endif
}
#endif
