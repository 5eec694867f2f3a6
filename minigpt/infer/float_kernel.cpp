// MiniGPT's float matrix-vector product for decode steps: the CPU kernel of the op minigpt::float_mv(x, weight),
// float32 activations times a float32 or bfloat16 matrix. Built into the native runner library (native_runner.cpp,
// whose build compiles this file beside it), registered in a Python process by mg_float_install, in the runner's
// own process when it opens a bundle. The same file holds minigpt::float_mm, the product for a prompt's rows
// (below float_mv).
//
// What it computes:
//   x       [rows, in] float32 (a decode step's few rows: one per sequence and new token);
//   weight  [out, in] float32 or bfloat16;
//   result  [rows, out] float32: y[m, n] = sum_k x[m, k] * w[n, k], every weight converted to float32 exactly (a
//           bfloat16 is the top half of a float32), the products accumulated in float32 by fused multiply-adds in
//           four chains of 16 (AVX-512) or 8 (AVX2) lanes, summed at the row's end. Only the order of the sum
//           differs from the compiled step's generated loops (minigpt/infer/fastpath/kernels.py, decode_linear).
//
// Why: with a bfloat16 model's products in this kernel, its AOTInductor step package's C++ source holds no
// matrix-vector loops, and the package compiles in about half the time (SmolLM-135M's shape, 2-core Zen 5 EPYC:
// 117.8 -> 62.2 s), decoding as fast as through the loops within that host's noise (and 1.35x as fast at 1.1B on
// an AVX2-only Zen 3, with the prefetch in dot_avx2). Both read the weights at the rate of a plain read matrix by
// matrix (38-43 GB/s for the fp32 step when a standalone read of its 120 layer matrices gave 39-43). Used by
// default on AMD CPUs only: on a Sapphire Rapids the loops, which read 8 blocks of rows at once, decoded 1.35x
// faster than this kernel, which reads one row after another (rows_avx512). A float32 package keeps the loops:
// through this kernel it decoded 0.92-0.98x on the Zen 5 (minigpt/infer/fastpath/float_mv.py; docs/benchmarks.md,
// sessions 59-60 and 69).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "runner_ops.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using minigpt_ops::kAvx2;
using minigpt_ops::kAvx512;
using minigpt_ops::kScalar;

// This CPU's best path, capped by $ATEN_CPU_CAPABILITY and $MINIGPT_FLOAT_MV_ISA (minigpt_ops::float_isa); read once.
minigpt_ops::FloatIsa chosen_isa() {
  static const minigpt_ops::FloatIsa isa = minigpt_ops::float_isa("MINIGPT_FLOAT_MV_ISA");
  return isa;
}

// 16 weights as float32 lanes: a float32 load, or bfloat16 widened to 32 bits and shifted into the top half.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const uint16_t* w) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const float* w, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, w);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load16(const uint16_t* w, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, w);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One weight row times M activation rows: y[m * ldy]. Four chains of fused multiply-adds per activation row, so
// that the adds' latency does not bound the loop; each sum is the same for any M.
template <int M, typename W>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void dot_avx512(const float* x, const W* row, int64_t in,
                                                                            float* y, int64_t ldy) {
  const int64_t wide = in / 64 * 64, full = in / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (in - full)) - 1);
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k < wide; k += 64) {
    for (int c = 0; c < 4; ++c) {
      const __m512 wv = load16(row + k + 16 * c);
      for (int m = 0; m < M; ++m) acc[m][c] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * in + k + 16 * c), wv, acc[m][c]);
    }
  }
  for (; k < full; k += 16) {
    const __m512 wv = load16(row + k);
    for (int m = 0; m < M; ++m) acc[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * in + k), wv, acc[m][0]);
  }
  if (tail) {
    const __m512 wv = load16(row + full, tail);
    for (int m = 0; m < M; ++m)
      acc[m][1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x + m * in + full), wv, acc[m][1]);
  }
  for (int m = 0; m < M; ++m) {
    const __m512 s = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
    y[m * ldy] = _mm512_reduce_add_ps(s);
  }
}

// Output rows [n0, n1) for `rows` activation rows: y[m * ldy + n]. Each weight row is read once, from its start to
// its end, for every activation row. (Reading 4-16 distant blocks of a thread's rows at once, as Inductor's loops
// do, was measured and dropped: 0.93-0.94x of the loops instead of 0.74x on a Sapphire Rapids, still behind them;
// 0.68-0.75x of one stream at bf16 and 0.64x at fp32 on the Zen 5 EPYC, docs/benchmarks.md, session 61.)
template <typename W>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void rows_avx512(const float* x, const W* w, int64_t rows,
                                                                      int64_t in, int64_t n0, int64_t n1, float* y,
                                                                      int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 2 <= rows; m += 2) dot_avx512<2>(x + m * in, w + n * in, in, y + m * ldy + n, ldy);
    if (m < rows) dot_avx512<1>(x + m * in, w + n * in, in, y + m * ldy + n, ldy);
  }
}

__attribute__((target("avx2,fma"))) inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float to_float(float w) { return w; }
inline float to_float(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The sum of the eight float lanes of v.
__attribute__((target("avx2,fma"))) inline float sum_lanes(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

template <int M, typename W>
__attribute__((target("avx2,fma"))) inline void dot_avx2(const float* x, const W* row, int64_t in, float* y,
                                                         int64_t ldy) {
  const int64_t wide = in / 32 * 32, full = in / 8 * 8;
  __m256 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k < wide; k += 32) {
    // bf16: 32 weights are one cache line. Asking for the line 1 KB ahead keeps more misses in flight than the
    // hardware prefetcher alone: on a 2-core AVX2-only Zen 3 EPYC a 1.1B bf16 step decoded 1.35x Inductor's loops
    // against 1.16-1.18x without it (paired in one process), SmolLM-135M's 0.97-1.02x against 0.89x. Past the
    // row's end it asks for the next row's, past the matrix's it is a hint that cannot fault (the address is made
    // as an integer: a pointer past the array would be undefined). A standalone copy reading float32 rows gained
    // nothing from it, so they do without.
    if constexpr (sizeof(W) == 2)
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<std::uintptr_t>(row + k) + 1024), _MM_HINT_T0);
    for (int c = 0; c < 4; ++c) {
      const __m256 wv = load8(row + k + 8 * c);
      for (int m = 0; m < M; ++m) acc[m][c] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * in + k + 8 * c), wv, acc[m][c]);
    }
  }
  for (; k < full; k += 8) {
    const __m256 wv = load8(row + k);
    for (int m = 0; m < M; ++m) acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * in + k), wv, acc[m][0]);
  }
  for (int m = 0; m < M; ++m) {
    float total = sum_lanes(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3])));
    for (int64_t j = full; j < in; ++j) total = std::fma(x[m * in + j], to_float(row[j]), total);
    y[m * ldy] = total;
  }
}

template <typename W>
__attribute__((target("avx2,fma"))) void rows_avx2(const float* x, const W* w, int64_t rows, int64_t in, int64_t n0,
                                                   int64_t n1, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 2 <= rows; m += 2) dot_avx2<2>(x + m * in, w + n * in, in, y + m * ldy + n, ldy);
    if (m < rows) dot_avx2<1>(x + m * in, w + n * in, in, y + m * ldy + n, ldy);
  }
}

// Two weight rows (w0, w1) times M <= 6 activation rows, for a short prompt's rows (float_mm): y[m * ldy + j],
// j = 0, 1. 2 M accumulators, one chain each (from M = 4 they cover the FMA latency of Zen 3 and Intel's cores),
// and each weight and activation load feeds M and two FMAs where dot_avx2's feed two and one: with many rows the
// product is bound by arithmetic and loads, not by the weights' bytes.
template <int M, typename W>
__attribute__((target("avx2,fma"))) inline void tile_avx2(const float* x, const W* w0, const W* w1, int64_t in,
                                                          float* y, int64_t ldy) {
  const int64_t full = in / 8 * 8;
  __m256 acc0[M], acc1[M];
  for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < full; k += 8) {
    const __m256 a = load8(w0 + k), b = load8(w1 + k);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * in + k);
      acc0[m] = _mm256_fmadd_ps(xv, a, acc0[m]);
      acc1[m] = _mm256_fmadd_ps(xv, b, acc1[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    float t0 = sum_lanes(acc0[m]), t1 = sum_lanes(acc1[m]);
    for (int64_t j = full; j < in; ++j) {
      t0 = std::fma(x[m * in + j], to_float(w0[j]), t0);
      t1 = std::fma(x[m * in + j], to_float(w1[j]), t1);
    }
    y[m * ldy] = t0;
    y[m * ldy + 1] = t1;
  }
}

// Output rows [n0, n1) for `rows` activation rows through tile_avx2, kChunkRows weight rows at a time (at most 98
// KB of bf16 at 1536 inputs: they stay in L2 while every pass of activation rows goes over them; in session 75,
// when the tiles took up to 128 rows, without the chunks a thread's whole range was read again for each pass,
// 1.24x ATen's GEMM's time at 245 rows instead of 0.93-1.04x). The fewest passes of at most kTileMax rows, even
// in size (13 rows: 5 + 4 + 4): before, passes of four left a last pass of one row whose two chains wait on the
// FMA's latency; every float32 and bf16 product of TinyLlama-1.1B / SmolLM-135M at 13 rows took 0.92x / 0.83x the
// time on a 2-core AVX2-only Zen 3 EPYC (paired medians; docs/benchmarks.md, session 79).
constexpr int64_t kChunkRows = 32, kTileMax = 6;

template <typename W>
__attribute__((target("avx2,fma"))) void tiles_avx2(const float* x, const W* w, int64_t rows, int64_t in, int64_t n0,
                                                    int64_t n1, float* y, int64_t ldy) {
  const int64_t passes = (rows + kTileMax - 1) / kTileMax;
  for (int64_t c0 = n0; c0 < n1; c0 += kChunkRows) {
    const int64_t c1 = std::min(n1, c0 + kChunkRows);
    for (int64_t p = 0, m = 0; p < passes; ++p) {
      const int64_t left = (rows - m) / (passes - p) + ((rows - m) % (passes - p) != 0);
      const float* xm = x + m * in;
      float* ym = y + m * ldy;
      int64_t n = c0;
      for (; n + 2 <= c1; n += 2) {
        const W *a = w + n * in, *b = a + in;
        switch (left) {
          case 6: tile_avx2<6>(xm, a, b, in, ym + n, ldy); break;
          case 5: tile_avx2<5>(xm, a, b, in, ym + n, ldy); break;
          case 4: tile_avx2<4>(xm, a, b, in, ym + n, ldy); break;
          case 3: tile_avx2<3>(xm, a, b, in, ym + n, ldy); break;
          case 2: tile_avx2<2>(xm, a, b, in, ym + n, ldy); break;
          default: tile_avx2<1>(xm, a, b, in, ym + n, ldy);
        }
      }
      if (n < c1)  // an odd last weight row
        for (int64_t r = 0; r < left; ++r) dot_avx2<1>(xm + r * in, w + n * in, in, ym + r * ldy + n, ldy);
      m += left;
    }
  }
}

// A prompt's many rows as a packed GEMM (float_mm above kTileRowsMax rows), blocked as BLIS-style GEMMs are: the
// rows are copied once into tiles of 6 (pack_rows); the weights of 16 output columns and up to kKc inputs are
// converted to float32 and transposed into a panel (32 KB at most, the size of L1), and each tile of rows passes
// over it in a 6 x 16 register tile (12 accumulators, each FMA's operands one broadcast and one panel load). A
// bf16 weight is converted once per block of kMc rows; before, slices converted for ATen's float32 GEMM were
// written out and read back.
constexpr int kMr = 6, kNr = 16;
constexpr int64_t kKc = 512, kMc = 256, kGroup = 4;

// c[m, j] (+)= sum over k < kc of x[k * 6 + m] * panel[k * 16 + j] for m < M, j < 16. The accumulators start at 0
// and c is added at the end: its lines, asked for at the start, arrive while the FMAs run (y's block is not in
// cache when a panel's first tile starts). They are named, not an array: GCC kept an array of them on the stack,
// storing all 12 on every step (half the speed).
template <int M>
__attribute__((target("avx2,fma"))) void micro_avx2(const float* x, const float* panel, int64_t kc, float* c,
                                                    int64_t ldc, bool add) {
  __m256 c0l, c0h, c1l, c1h, c2l, c2h, c3l, c3h, c4l, c4h, c5l, c5h;
  c0l = c0h = c1l = c1h = c2l = c2h = c3l = c3h = c4l = c4h = c5l = c5h = _mm256_setzero_ps();
#define MG_ROWS(DO) DO(0, c0l, c0h) DO(1, c1l, c1h) DO(2, c2l, c2h) DO(3, c3l, c3h) DO(4, c4l, c4h) DO(5, c5l, c5h)
#define MG_PREFETCH(m, lo, hi)                                                      \
  if constexpr (M > m) {                                                        \
    _mm_prefetch(reinterpret_cast<const char*>(c + m * ldc), _MM_HINT_T0);      \
    _mm_prefetch(reinterpret_cast<const char*>(c + m * ldc + 15), _MM_HINT_T0); \
  }
#define MG_FMA(m, lo, hi)                                           \
  if constexpr (M > m) {                                            \
    const __m256 a = _mm256_broadcast_ss(x + k * kMr + m);          \
    lo = _mm256_fmadd_ps(a, b0, lo);                                \
    hi = _mm256_fmadd_ps(a, b1, hi);                                \
  }
#define MG_STORE(m, lo, hi)                                                                \
  if constexpr (M > m) {                                                                   \
    _mm256_storeu_ps(c + m * ldc, add ? _mm256_add_ps(_mm256_loadu_ps(c + m * ldc), lo) : lo); \
    _mm256_storeu_ps(c + m * ldc + 8, add ? _mm256_add_ps(_mm256_loadu_ps(c + m * ldc + 8), hi) : hi); \
  }
  MG_ROWS(MG_PREFETCH)
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(panel + k * kNr), b1 = _mm256_load_ps(panel + k * kNr + 8);
    MG_ROWS(MG_FMA)
  }
  MG_ROWS(MG_STORE)
#undef MG_ROWS
#undef MG_PREFETCH
#undef MG_FMA
#undef MG_STORE
}

// r[i][j] -> r[j][i] for 8 rows of 8 floats.
__attribute__((target("avx2,fma"))) inline void transpose8(__m256 r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
  }
}

// panel[k * 16 + j] = w[n + j, k0 + k] as float32 for k < kc, j < cols, and 0 for j >= cols.
template <typename W>
__attribute__((target("avx2,fma"))) void pack_avx2(const W* w, int64_t in, int64_t n, int64_t cols, int64_t k0,
                                                   int64_t kc, float* panel) {
  int64_t k = 0;
  if (cols == kNr)
    for (; k + 8 <= kc; k += 8)
      for (int half = 0; half < 2; ++half) {
        __m256 r[8];
        for (int j = 0; j < 8; ++j) r[j] = load8(w + (n + 8 * half + j) * in + k0 + k);
        transpose8(r);
        for (int j = 0; j < 8; ++j) _mm256_store_ps(panel + (k + j) * kNr + 8 * half, r[j]);
      }
  for (; k < kc; ++k)
    for (int j = 0; j < kNr; ++j) panel[k * kNr + j] = j < cols ? to_float(w[(n + j) * in + k0 + k]) : 0.0f;
}

// x [rows, in] as tiles of kMr rows, each [in, kMr] (the last tile's missing rows 0): a step's six broadcasts
// read one line, not six rows `in` apart. Tiles [t0, t1) of out.
void pack_rows(const float* x, int64_t rows, int64_t in, int64_t t0, int64_t t1, float* out) {
  for (int64_t t = t0; t < t1; ++t)
    for (int r = 0; r < kMr; ++r) {
      const int64_t m = t * kMr + r;
      float* dst = out + t * in * kMr + r;
      for (int64_t k = 0; k < in; ++k) dst[k * kMr] = m < rows ? x[m * in + k] : 0.0f;
    }
}

// y[m, n] for every row m and the output columns [n0, n1) (a thread's share, in steps of 16 but for the last), x
// packed by pack_rows. Loops, outer to inner: blocks of kMc rows; groups of kGroup panels, whose [kMc, 64] block
// of y stays in L2 while every block of kKc inputs passes (y is read and written once per block of inputs;
// without the groups, with 256 inputs a block, y [245, 5632] went to memory and back for each: 55-65 GFLOP/s on
// one thread of the Zen 3 against 62-80 standalone, noisy); panels; tiles of rows.
template <typename W>
__attribute__((target("avx2,fma"))) void gemm_avx2(const float* xp, const W* w, int64_t rows, int64_t in, int64_t n0,
                                                   int64_t n1, float* y, int64_t ldy) {
  using Micro = void (*)(const float*, const float*, int64_t, float*, int64_t, bool);
  static constexpr Micro kMicro[kMr + 1] = {nullptr,        micro_avx2<1>, micro_avx2<2>, micro_avx2<3>,
                                            micro_avx2<4>, micro_avx2<5>, micro_avx2<6>};
  alignas(64) float panel[kKc * kNr];
  alignas(64) float edge[kMr * kNr];  // a tile of the matrix's last columns, when fewer than 16
  const int64_t blocks = (rows + kMc - 1) / kMc, mc = ((rows + blocks - 1) / blocks + kMr - 1) / kMr * kMr;
  const int64_t steps = (in + kKc - 1) / kKc, kStep = ((in + steps - 1) / steps + 7) / 8 * 8;  // 576 = 2 x 288
  for (int64_t m0 = 0; m0 < rows; m0 += mc) {
    const int64_t m1 = std::min(rows, m0 + mc);
    for (int64_t g0 = n0; g0 < n1; g0 += kGroup * kNr) {
      const int64_t g1 = std::min(n1, g0 + kGroup * kNr);
      for (int64_t k0 = 0; k0 < in; k0 += kStep) {
        const int64_t kc = std::min(kStep, in - k0);
        for (int64_t n = g0; n < g1; n += kNr) {
          const int64_t cols = std::min<int64_t>(kNr, g1 - n);
          pack_avx2(w, in, n, cols, k0, kc, panel);
          for (int64_t m = m0; m < m1; m += kMr) {
            const int left = static_cast<int>(std::min<int64_t>(kMr, m1 - m));
            const float* xm = xp + m * in + k0 * kMr;
            if (cols == kNr) {
              kMicro[left](xm, panel, kc, y + m * ldy + n, ldy, k0 > 0);
              continue;
            }
            for (int r = 0; r < left; ++r)
              for (int64_t j = 0; j < cols; ++j) edge[r * kNr + j] = k0 ? y[(m + r) * ldy + n + j] : 0.0f;
            kMicro[left](xm, panel, kc, edge, kNr, k0 > 0);
            for (int r = 0; r < left; ++r)
              for (int64_t j = 0; j < cols; ++j) y[(m + r) * ldy + n + j] = edge[r * kNr + j];
          }
        }
      }
    }
  }
}

template <typename W>
void rows_scalar(const float* x, const W* w, int64_t rows, int64_t in, int64_t n0, int64_t n1, float* y,
                 int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < rows; ++m) {
      float total = 0.0f;
      for (int64_t k = 0; k < in; ++k) total = std::fma(x[m * in + k], to_float(w[n * in + k]), total);
      y[m * ldy + n] = total;
    }
}

template <typename W>
void product(const float* x, const W* w, int64_t rows, int64_t in, int64_t out, float* y) {
  const auto pass = chosen_isa() == kAvx512 ? rows_avx512<W> : chosen_isa() == kAvx2 ? rows_avx2<W> : rows_scalar<W>;
  at::parallel_for(0, (out + 15) / 16, 1, [&](int64_t begin, int64_t end) {  // in units of 16 rows
    pass(x, w, rows, in, begin * 16, std::min(out, end * 16), y, out);
  });
}

// Both ops' arguments: float32 rows [rows, in] and a float32 or bfloat16 matrix [out, in] on the CPU.
void check_operands(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op, ": x must be float32 [rows, in]");
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16) &&
                  weight.size(1) == x.size(1),
              op, ": weight must be float32 or bfloat16 [out, ", x.size(1), "]");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, ": CPU tensors only");
}

at::Tensor float_mv(const at::Tensor& x, const at::Tensor& weight) {
  check_operands("minigpt::float_mv", x, weight);
  at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t rows = xc.size(0), in = xc.size(1), out = wc.size(0);
  at::Tensor y = at::empty({rows, out}, xc.options());
  if (rows == 0 || out == 0) return y;
  if (in == 0) return y.zero_();
  if (wc.scalar_type() == at::kFloat)
    product(xc.data_ptr<float>(), wc.data_ptr<float>(), rows, in, out, y.data_ptr<float>());
  else
    product(xc.data_ptr<float>(), reinterpret_cast<const uint16_t*>(wc.data_ptr<c10::BFloat16>()), rows, in, out,
            y.data_ptr<float>());
  return y;
}

// minigpt::float_mm: the same product for a prompt's rows, any number (a prefill package's, whose rows are known
// only when it runs). Up to kTileRowsMax rows: tiles_avx2, each weight converted in registers and used for up to six
// activation rows (the weights' bytes bound the product). More rows: gemm_avx2, each weight converted once per
// block of kMc rows into its panel. SmolLM-135M's 120 matrices in bf16 on a 2-core AVX2-only Zen 3 EPYC, eager,
// medians of 5 in one process (session 77): the GEMM's time / the tiles' 1.31x at 4 rows, 1.15x at 13, 1.04x at
// 16, 0.90x at 24, 0.72-0.93x at 32-128; / slices converted for ATen's float32 GEMM (the path above 128 rows
// before) 0.74-0.77x at 245 rows, 0.85x at 512, and 0.74x for TinyLlama-1.1B's 88 at 245. Without AVX2: ATen's
// GEMM on a float32 copy.
constexpr int64_t kTileRowsMax = 16;
constexpr size_t kPackedKeep = 16 << 20;  // floats (64 MiB): a larger buffer of packed rows is freed after the call

at::Tensor float_mm(const at::Tensor& x, const at::Tensor& weight) {
  check_operands("minigpt::float_mm", x, weight);
  const int64_t rows = x.size(0), in = x.size(1), out = weight.size(0);
  if (rows == 0 || in == 0 || out == 0 || (rows <= kTileRowsMax && chosen_isa() == kScalar))
    return float_mv(x, weight);
  at::Tensor xc = x.contiguous();
  if (chosen_isa() == kScalar) return at::mm(xc, weight.to(at::kFloat).t());
  at::Tensor wc = weight.contiguous(), y = at::empty({rows, out}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool tiles = rows <= kTileRowsMax;
  // More rows are packed into this thread's buffer, kept from call to call: a new one each time would be fresh
  // pages that the kernel faults in and zeroes.
  static thread_local std::vector<float> packed;
  const int64_t row_tiles = (rows + kMr - 1) / kMr;
  if (!tiles && packed.size() < static_cast<size_t>(row_tiles * kMr * in)) packed.resize(row_tiles * kMr * in);
  float* pp = packed.data();
  if (!tiles)
    at::parallel_for(0, row_tiles, 1, [&](int64_t begin, int64_t end) { pack_rows(xp, rows, in, begin, end, pp); });
  const auto run = [&](const auto* w) {
    at::parallel_for(0, (out + kNr - 1) / kNr, 1, [&](int64_t begin, int64_t end) {  // in units of 16 weight rows
      const int64_t n0 = begin * kNr, n1 = std::min(out, end * kNr);
      if (tiles)
        tiles_avx2(xp, w, rows, in, n0, n1, yp, out);
      else
        gemm_avx2(pp, w, rows, in, n0, n1, yp, out);
    });
  };
  if (wc.scalar_type() == at::kBFloat16)
    run(reinterpret_cast<const uint16_t*>(wc.data_ptr<c10::BFloat16>()));
  else
    run(wc.data_ptr<float>());
  if (packed.size() > kPackedKeep) std::vector<float>().swap(packed);
  return y;
}

std::string float_mv_isa() { return minigpt_ops::kFloatIsaNames[chosen_isa()]; }

minigpt_ops::Registration registration;

void register_float_op() {
  minigpt_ops::register_once(registration, "minigpt::float_mv", [](torch::Library& def, bool define,
                                                                   torch::Library& impl) {
    if (define) {
      def.def("float_mv(Tensor x, Tensor weight) -> Tensor");
      def.def("float_mm(Tensor x, Tensor weight) -> Tensor");
    }
    def.def("float_mv_isa() -> str", TORCH_FN(float_mv_isa));
    impl.impl("float_mv", TORCH_FN(float_mv));
    impl.impl("float_mm", TORCH_FN(float_mm));
  });
}

}  // namespace

extern "C" {

// The C++ kernel of minigpt::float_mv for this process (a Python process, or the runner before it loads a package
// that calls the op). Returns 0, or -1 with the reason in `err`.
int mg_float_install(char* err, int errlen) { return minigpt_ops::report(register_float_op, err, errlen); }

}  // extern "C"
