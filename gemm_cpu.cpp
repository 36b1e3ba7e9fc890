// A prompt's products over tiled int8 / int4 codes in integer dot products (AVX-512 VNNI and AVX2 builds; built
// with kernels_cpu.cpp, whose TORCH_LIBRARY this fragment adds its ops to).
//
// The one-token kernels (kernels_cpu.cpp int8_tile_dots / int4_tile_dots) as a GEMM: each vpdpbusd multiplies
// 64 codes by 4 activation codes broadcast, 64 multiply-adds where bfloat16's vdpbf16ps does 32 (AVX2's
// vpmaddubsw: 32, where an fp32 FMA does 8), and the codes are read as stored, not first dequantized into a dense
// weight. A micro-tile of MR activation rows by NT tiles of 16 output rows keeps its accumulators in registers,
// so every weight vector loaded serves MR rows and every activation broadcast NT tiles. The order of each
// output's sums is the one-token kernel's, so every row of the product equals that kernel's output for the row,
// bit for bit.

#include "kernels_cpu.h"

#if defined(KVFAST_AVX2)  // AVX-512 builds have AVX2 too
namespace {

// A micro-tile's activation rows (MR_ROWS; MR_GROUPS for int4 products whose groups span several blocks, which
// hold a third set of accumulators, each group's sums) and tiles of 16 output rows (NT): AVX-512's 32 vector
// registers hold 6 x 2 tiles; AVX2's 16 hold 3 rows of one tile (two vectors of 8 rows), whose integer sums stay
// in registers (4 rows spilled some and ran at 0.90-0.93x the speed; two tiles of 2 or 3 rows, slower still).
#if defined(KVFAST_AVX512)
constexpr int MR_ROWS = 6, MR_GROUPS = 4, NT = 2;
#else
constexpr int MR_ROWS = 3, MR_GROUPS = 3, NT = 1;
#endif
// Activation codes per chunk of rows that a thread's tiles all multiply before the next chunk: they stay in
// its share of L2 (a prompt's 2048 rows of 1536 codes did not, and their broadcasts waited on L3).
#ifndef CHUNK_BYTES
#define CHUNK_BYTES (256 * 1024)
#endif
// Up to this many rows a micro-tile takes one tile: the codes of two stream from memory slower than one's.
constexpr int64_t ONE_TILE_ROWS = 3;

// How a micro-tile scales its integer sums: int8 codes (stored + 128: in AVX-512 builds each block's sum starts
// from the rows' block_bias; one scale per output row at the end), or int4 codes (per group of `group` columns:
// scale and offset, float32 or float16 S; ONE_BLOCK: groups of 32, where a group's sum is its one block's).
struct Int8Scales {
  const float* scales;  // this micro-tile's first output row's
};
template <typename S, bool ONE_BLOCK>
struct Int4Scales {
  static constexpr bool one_block = ONE_BLOCK;
  const S* scales;  // [n_groups][16] per tile, from this micro-tile's first tile
  const S* offsets;
  int64_t tile_stride, group;
};

// A micro-tile's fp32 accumulators for M rows by K vectors of Vec::W outputs (each lane one output row of a 16-row
// tile): a block's integer sums (sums[m][k], as floats) scaled as the one-token kernels scale them, in their order,
// and the outputs stored (float32, or bfloat16 rounded to nearest even).
template <int M, int K, typename Scales>
struct Accumulators {
  static constexpr bool int4 = !std::is_same_v<Scales, Int8Scales>;
  Vec::reg acc[M][K], gacc[M][K];  // gacc: int4's sum over the group so far of d * (integer block sums)

  Accumulators() {
    for (int m = 0; m < M; ++m)
      for (int k = 0; k < K; ++k) acc[m][k] = Vec::zero();
  }
  // int8: d * sums; int4: d * sums over the group, then times its scales, plus its offsets times the rows' group
  // sums (the scales and offsets of vector k's W rows: tile k * W / 16, from row k * W % 16)
  void add_block(const Vec::reg (&sums)[M][K], const QRow* const* r, int64_t b, const Scales& sc) {
    if constexpr (!int4) {
      for (int m = 0; m < M; ++m) {
        const Vec::reg d = Vec::set1(r[m]->d_lane[b / 4]);
        for (int k = 0; k < K; ++k) acc[m][k] = Vec::fmadd(sums[m][k], d, acc[m][k]);
      }
    } else {
      const bool first = Scales::one_block || b % sc.group == 0, last = Scales::one_block || (b + QK) % sc.group == 0;
      for (int m = 0; m < M; ++m) {
        const Vec::reg d = Vec::set1(r[m]->d_lane[b / 4]);
        for (int k = 0; k < K; ++k)  // the first as fma(., ., 0)
          gacc[m][k] = first ? Vec::mul(sums[m][k], d) : Vec::fmadd(sums[m][k], d, gacc[m][k]);
      }
      if (!last) return;
      const int64_t g = Scales::one_block ? b / QK : b / sc.group;
      for (int k = 0; k < K; ++k) {
        const int64_t at = k * Vec::W / TR * sc.tile_stride + g * TR + k * Vec::W % TR;
        const Vec::reg scale = Vec::load(sc.scales + at), offset = Vec::load(sc.offsets + at);
        for (int m = 0; m < M; ++m) {
          acc[m][k] = Vec::fmadd(gacc[m][k], scale, acc[m][k]);
          acc[m][k] = Vec::fmadd(offset, Vec::set1(r[m]->group_sum[g]), acc[m][k]);
        }
      }
    }
  }
  // int8: times the rows' scales; row m to y + m * ldy
  template <typename Y>
  void store(const Scales& sc, Y* y, int64_t ldy) {
    for (int m = 0; m < M; ++m)
      for (int k = 0; k < K; ++k) {
        if constexpr (!int4) acc[m][k] = Vec::mul(acc[m][k], Vec::load(sc.scales + k * Vec::W));
        Vec::storeu(y + m * ldy + k * Vec::W, acc[m][k]);
      }
  }
};

#if defined(KVFAST_AVX512)
// Rows r[0..M) times N tiles of codes in tile_int8's layout ([in / 4][16 rows][4 columns], tile n at
// w + n * stride; int4 codes unpacked to bytes 0..15 first) into y (row m at y + m * ldy).
template <int M, int N, typename Scales, typename Y>
void micro(const uint8_t* w, int64_t stride, const QRow* const* r, int64_t in, const Scales& sc, Y* y, int64_t ldy) {
  constexpr bool int4 = !std::is_same_v<Scales, Int8Scales>;
  Accumulators<M, N, Scales> out;
  // at least 4 independent chains of dpbusd hide its latency: a micro-tile of fewer outputs splits each block's
  // sums in C (exact integers, added after)
  constexpr int C = M * N >= 4 ? 1 : (M * N == 1 ? 4 : 2);
  for (int64_t b = 0; b < in; b += QK) {
    __m512i part[C][M][N];
    for (int m = 0; m < M; ++m) {
      const __m512i start = int4 ? _mm512_setzero_si512() : _mm512_set1_epi32(r[m]->block_bias[b / QK]);
      for (int n = 0; n < N; ++n) {
        part[0][m][n] = start;
        for (int c = 1; c < C; ++c) part[c][m][n] = _mm512_setzero_si512();
      }
    }
    const uint8_t* wb = w + b * TR;
#pragma GCC unroll 8
    for (int k = 0; k < QK / 4; ++k) {
      __m512i wv[N];
      for (int n = 0; n < N; ++n) wv[n] = _mm512_loadu_si512(wb + n * stride + 64 * k);
      for (int m = 0; m < M; ++m) {
        const __m512i a = broadcast4(r[m]->q + b + 4 * k);
        for (int n = 0; n < N; ++n) part[k % C][m][n] = _mm512_dpbusd_epi32(part[k % C][m][n], wv[n], a);
      }
    }
    // (int4_tile_dots scales 16 x a block's sum by d / 16: the same product, exactly, |16 s| < 2^24)
    __m512 sums[M][N];
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) {
        __m512i s = part[0][m][n];
        for (int c = 1; c < C; ++c) s = _mm512_add_epi32(s, part[c][m][n]);
        sums[m][n] = _mm512_cvtepi32_ps(s);
      }
    out.add_block(sums, r, b, sc);
  }
  out.store(sc, y, ldy);
}

#else
// As the AVX-512 micro-kernel, each tile as two vectors of 8 rows (h), with int4_tile_dots' and int8_tile_dots'
// AVX2 arithmetic: int4 codes (0..15) times the activations add up in int16 over a block (8 pairs a lane, at most
// 30,480); int8 codes (stored + 128) get their sign back, and vpmaddubsw multiplies |code| by the activations
// carrying the code's sign, each pair's sum widened to int32 at once.
template <int M, int N, typename Scales, typename Y>
void micro(const uint8_t* w, int64_t stride, const QRow* const* r, int64_t in, const Scales& sc, Y* y, int64_t ldy) {
  constexpr bool int4 = !std::is_same_v<Scales, Int8Scales>;
  constexpr int H = 2 * N;
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  Accumulators<M, H, Scales> out;
  for (int64_t b = 0; b < in; b += QK) {
    __m256i s[M][H];
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < H; ++h) s[m][h] = _mm256_setzero_si256();
    const uint8_t* wb = w + b * TR;
#pragma GCC unroll 8
    for (int k = 0; k < QK / 4; ++k) {
      __m256i wv[H], sign[H];
      for (int h = 0; h < H; ++h) {
        wv[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + h / 2 * stride + 64 * k + 32 * (h % 2)));
        if constexpr (!int4) {
          sign[h] = _mm256_xor_si256(wv[h], flip);
          wv[h] = _mm256_sign_epi8(sign[h], sign[h]);
        }
      }
      for (int m = 0; m < M; ++m) {
        const __m256i a = broadcast4_256(r[m]->q + b + 4 * k);
        for (int h = 0; h < H; ++h) {
          if constexpr (int4) {
            s[m][h] = _mm256_add_epi16(s[m][h], _mm256_maddubs_epi16(wv[h], a));
          } else {
            const __m256i pairs = _mm256_maddubs_epi16(wv[h], _mm256_sign_epi8(a, sign[h]));
            s[m][h] = _mm256_add_epi32(s[m][h], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
    }
    __m256 sums[M][H];
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < H; ++h) sums[m][h] = _mm256_cvtepi32_ps(int4 ? _mm256_madd_epi16(s[m][h], ones) : s[m][h]);
    out.add_block(sums, r, b, sc);
  }
  out.store(sc, y, ldy);
}
#endif

// Every (m, n) <= (M, N) instance of a micro-kernel, chosen at run time for a block's rows m and tiles n.
template <int M, int N, typename Call>
void dispatch(int m, int n, const Call& call) {
  if constexpr (M > 1) {
    if (m < M) return dispatch<M - 1, N>(m, n, call);
  }
  if constexpr (N > 1) {
    if (n < N) return dispatch<M, N - 1>(m, n, call);
  }
  call(std::integral_constant<int, M>{}, std::integral_constant<int, N>{});
}

// n tiles of codes from tile t in tile_int8's layout: stored tiles are read in place; int4 tiles and codes in
// rows (quantize.py's) are rearranged into `buffer`, once per group of tiles for every row of the product.
struct Codes {
  const uint8_t* w;
  int64_t in;
  bool int4, tiled;

  const uint8_t* tiles(int64_t t, int n, std::vector<uint8_t>& buffer) const {
    const int64_t tile_bytes = TR * in;
    if (tiled && !int4) return w + t * tile_bytes;
    buffer.resize(n * tile_bytes);
    for (int j = 0; j < n; ++j) {
      uint8_t* dst = buffer.data() + j * tile_bytes;
      if (tiled) {  // tile_int4: [in / 8][16 rows][4 bytes], byte i holding column 8c + i low and 8c + 4 + i high
        const uint8_t* src = w + (t + j) * tile_bytes / 2;
        for (int64_t c = 0; c < tile_bytes / 2; c += 64)
          for (int i = 0; i < 64; ++i) {
            dst[2 * c + i] = src[c + i] & 0x0F;
            dst[2 * c + 64 + i] = src[c + i] >> 4;
          }
        continue;
      }
      // rows: 4 columns of 16 rows gathered as one 32-bit word per row (int8: code + 128; int4: column c < in / 2
      // in the low nibbles of byte c, column c + in / 2 in the high ones)
      const int64_t row_bytes = int4 ? in / 2 : in;
      const uint8_t* src = w + (t + j) * TR * row_bytes;
      for (int64_t c = 0; c < in; c += 4) {
        const int64_t at = int4 && c >= in / 2 ? c - in / 2 : c;
        for (int row = 0; row < TR; ++row) {
          uint32_t v;
          std::memcpy(&v, src + row * row_bytes + at, 4);
          v = !int4 ? v ^ 0x80808080u : (c >= in / 2 ? v >> 4 : v) & 0x0F0F0F0Fu;
          std::memcpy(dst + c * TR + 4 * row, &v, 4);
        }
      }
    }
    return buffer.data();
  }
};

// The output's tiles in groups of NT (one for up to ONE_TILE_ROWS rows) split between threads; each group runs
// over every block of M rows of a chunk while its codes stay in L1; run(M, N, t, codes, rows, y) runs one
// micro-tile.
template <int M, typename Y, typename Run>
at::Tensor over_micro_tiles(const at::Tensor& x, int64_t out, const QRows& q, const Codes& codes,
                            const Run& run) {
  at::Tensor y = output_like(x, out);
  Y* yp = y.data_ptr<Y>();
  const int64_t rows = static_cast<int64_t>(q.size()), tiles = out / TR;
  const int64_t nt = rows <= ONE_TILE_ROWS ? 1 : NT;
  const int64_t chunk = std::max<int64_t>(1, CHUNK_BYTES / codes.in / M) * M;
  at::parallel_for(0, (tiles + nt - 1) / nt, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> buffer;
    const QRow* r[M];
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      for (int64_t t = begin * nt; t < std::min(end * nt, tiles); t += nt) {
        const int n = static_cast<int>(std::min<int64_t>(nt, tiles - t));
        const uint8_t* w = codes.tiles(t, n, buffer);
        for (int64_t m0 = r0; m0 < std::min(r0 + chunk, rows); m0 += M) {
          const int m = static_cast<int>(std::min<int64_t>(M, rows - m0));
          for (int i = 0; i < m; ++i) r[i] = &q[m0 + i];
          dispatch<M, NT>(m, n, [&](auto MM, auto NN) { run(MM, NN, t, w, r, yp + m0 * out + t * TR); });
        }
      }
    }
  });
  return y;
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": float32 or bfloat16 x");
}

// x [..., in] float32 / bfloat16 @ the int8 codes' [out, in] (in rows or tiled), times their row scales: y like x.
at::Tensor int8_gemm(const at::Tensor& x_, const at::Tensor& codes_, const at::Tensor& scales_, bool tiled) {
  check_rows(x_, "int8_gemm");
  TORCH_CHECK(codes_.scalar_type() == at::kChar, "int8_gemm: int8 codes");
  const at::Tensor x = x_.contiguous(), codes = codes_.contiguous(), scales = scales_.to(at::kFloat).contiguous();
  const int64_t in = x.size(-1), out = codes.size(0);
  TORCH_CHECK(codes.size(1) == in && in % QK == 0 && out % TR == 0,
              "int8_gemm: in must match and be a multiple of 32, out a multiple of 16");
  const float* sp = scales.data_ptr<float>();
  const auto q = quantize_rows(x, 0);
  const Codes codes_of{reinterpret_cast<const uint8_t*>(codes.data_ptr<int8_t>()), in, false, tiled};
  const auto run = [&](auto* typed) {
    using Y = std::remove_pointer_t<decltype(typed)>;
    return over_micro_tiles<MR_ROWS, Y>(x, out, q, codes_of, [&](auto M, auto N, int64_t t, const uint8_t* w,
                                                                 const QRow* const* r, Y* y) {
      micro<M, N>(w, TR * in, r, in, Int8Scales{sp + t * TR}, y, out);
    });
  };
  return x.scalar_type() == at::kFloat ? run(static_cast<float*>(nullptr)) : run(static_cast<at::BFloat16*>(nullptr));
}

// x [..., in] @ int4 weights (quantize.py's codes, scales and offsets, in rows or all three tiled): y like x.
at::Tensor int4_gemm(const at::Tensor& x_, const at::Tensor& packed_, const at::Tensor& scales_,
                     const at::Tensor& offsets_, bool tiled) {
  check_rows(x_, "int4_gemm");
  TORCH_CHECK(packed_.scalar_type() == at::kByte, "int4_gemm: uint8 codes");
  const int64_t in = x_.size(-1), out = packed_.size(0), n_groups = scales_.size(1), group = in / n_groups;
  TORCH_CHECK(packed_.size(1) * 2 == in && group % QK == 0 && n_groups * group == in && out % TR == 0,
              "int4_gemm: groups of a multiple of 32 columns, out a multiple of 16");
  // the micro-kernel reads scales and offsets per tile ([n_groups][16 rows]); float16 where tiles keep them so
  const auto per_tile = [&](const at::Tensor& t) {
    return tiled ? t.contiguous() : t.view({out / TR, TR, n_groups}).transpose(1, 2).contiguous();
  };
  const bool half = tiled && scales_.scalar_type() == at::kHalf && offsets_.scalar_type() == at::kHalf;
  const at::ScalarType stored = half ? at::kHalf : at::kFloat;
  const at::Tensor x = x_.contiguous(), packed = packed_.contiguous();
  const at::Tensor scales = per_tile(scales_.to(stored)), offsets = per_tile(offsets_.to(stored));
  const auto q = quantize_rows(x, group);
  const Codes codes_of{packed.data_ptr<uint8_t>(), in, true, tiled};
  const auto run = [&](auto* typed, const auto* sp, const auto* op) {
    using Y = std::remove_pointer_t<decltype(typed)>;
    using S = std::remove_const_t<std::remove_pointer_t<decltype(sp)>>;
    const auto product = [&](auto one_block) {
      constexpr bool ONE = decltype(one_block)::value;
      return over_micro_tiles<ONE ? MR_ROWS : MR_GROUPS, Y>(x, out, q, codes_of, [&](auto M, auto N, int64_t t,
                                                                                     const uint8_t* w, const QRow* const* r, Y* y) {
        const Int4Scales<S, ONE> sc{sp + t * TR * n_groups, op + t * TR * n_groups, TR * n_groups, group};
        micro<M, N>(w, TR * in, r, in, sc, y, out);
      });
    };
    return group == QK ? product(std::true_type{}) : product(std::false_type{});
  };
  const auto typed = [&](const auto* sp, const auto* op) {
    return x.scalar_type() == at::kFloat ? run(static_cast<float*>(nullptr), sp, op)
                                         : run(static_cast<at::BFloat16*>(nullptr), sp, op);
  };
  return half ? typed(scales.data_ptr<at::Half>(), offsets.data_ptr<at::Half>())
              : typed(scales.data_ptr<float>(), offsets.data_ptr<float>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(KVFAST_NS, m) {
  m.def("int8_gemm(Tensor x, Tensor codes, Tensor scales, bool tiled) -> Tensor");
  m.def("int4_gemm(Tensor x, Tensor packed, Tensor scales, Tensor offsets, bool tiled) -> Tensor");
}

TORCH_LIBRARY_IMPL(KVFAST_NS, CPU, m) {
  m.impl("int8_gemm", &int8_gemm);
  m.impl("int4_gemm", &int4_gemm);
}
#endif
