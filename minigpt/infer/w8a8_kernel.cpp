// MiniGPT's own int8 x int8 product for a few activation rows (decode steps): the kernel the op minigpt::w8a8_mm
// (native_runner.cpp) uses for up to 4 rows on a CPU with AVX512-VNNI, in place of FBGEMM's, and for every call on a
// CPU with AVX2 but not VNNI, where FBGEMM's product is not exact (rows_avx2_bytes and rows_avx2 below). It reads the
// int8 matrix as it lies in memory, row by row, so nothing has to be repacked when a bundle is opened: FBGEMM's packing
// of SmolLM-135M's int8 matrices took 0.5-0.75 s of a ~2 s one-shot CLI call (docs/benchmarks.md).
//
// What it computes, bit for bit what FBGEMM's quantized::linear_with_input_q_dq_qweight_dq_output_fp32 computes
// with input scale 1 and zero point 128 (minigpt/infer/fastpath/library.py, w8a8_linear):
//   x      [rows, in] float32, already divided by its row's scale;
//   q      = clamp(round-half-even(x + 128), 0, 255) - 128, the sum x + 128 rounded to float32 first, as FBGEMM's
//            quantizer computes it (QuantizeAvx2, one fused multiply-add by the inverse scale 1 plus the zero point:
//            a value within float32 rounding of a half, 1.4999999 say, becomes 129.5 and rounds to 130, where
//            round(x) gives 1; measured: 3 of 200 random 4 x 192 x 576 products differ from the exact ones so);
//            NaN gives 127 (FBGEMM's clip, min(NaN, limit), returns the limit);
//   weight [out, in] int8, row-major, and scale [out] float32 (per output row, symmetric);
//   y[m, n] = float(sum_k q[m, k] * w[n, k]) * scale[n], the sum exact in int32.
//
// How: `vpdpbusd` multiplies unsigned by signed bytes, four products summed into each int32 lane. The weights are
// made unsigned by flipping their top bit (w + 128) and the activations stay signed, so each 64-byte load of a
// weight row takes one instruction, and the offset, 128 * sum_k q[m, k], is one number per activation row,
// subtracted at the end. The weight rows are read one after another, each from its start to its end: the matrix as
// one sequential stream, which the hardware prefetchers follow. The activation rows (a few KB) stay in L1 and are
// loaded again for each weight row; a row's 16 lanes are summed once, at its end. No torch headers here: the threads
// come from the caller (native_runner.cpp).
//
// Why one row at a time: until session 56 four weight rows were read side by side, chunk by chunk, so that they
// shared each activation load. On an AMD EPYC (Zen 4, family 25 model 17) that order streamed SmolLM-135M's int8
// matrices at 18-20 GB/s against 27-37 GB/s for rows in turn (the same integers); a plain read of as many bytes
// measured 30 GB/s there (docs/benchmarks.md, session 56).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace minigpt_w8a8 {

enum Isa { kNone = 0, kAvx2 = 1, kVnni = 2 };

constexpr int kMaxRows = 4;  // activation rows sharing one pass over the weights
// Weight rows per block when a call has more activation rows than one pass takes (product): 16 rows of 2,048 bytes
// (32 KB) stay in L1 and L2 while every pass reads them. On the 2-core Zen 3 EPYC (family 25 model 1), 512 rows
// through TinyLlama-1.1B's int8 layer matrices (session 70): 16 rows 1.49-1.54x the float32 GEMM on upcast weights,
// 64 rows 1.51x, 8 and 32 1.19-1.20x (one run each, the host noisy).
constexpr int64_t kBlockRows = 16;
// Bytes ahead of the weight read to prefetch. With four rows read side by side (before session 56) the product ran
// no faster than FBGEMM's without it (SmolLM-135M's 120 layer matrices, one row, 2 threads, Xeon model 207: 1.00x
// FBGEMM; 4 KB 1.44x, 8 KB 1.52x). Rows in turn, on the Zen 4 EPYC: 3.6-4.9 ms a token at 4 KB, 3.8-4.6 without.
constexpr int64_t kPrefetch = 4096;

// Which path runs here, read once: AVX512-VNNI (with BW for the byte loads), else AVX2, else none. Capped by
// $ATEN_CPU_CAPABILITY (PyTorch's switch for running as on an older CPU: avx2, or default for none) and by
// $MINIGPT_W8A8_ISA=avx2 (tests of the AVX2 path on a VNNI CPU); $MINIGPT_W8A8_KERNEL=fbgemm turns the kernel off
// (every call to FBGEMM, A/B measurements).
Isa isa() {
  static const Isa chosen = [] {
    __builtin_cpu_init();
    const char* choice = std::getenv("MINIGPT_W8A8_KERNEL");
    if (choice != nullptr && std::string(choice) == "fbgemm") return kNone;
    Isa best = __builtin_cpu_supports("avx2") ? kAvx2 : kNone;
    if (best == kAvx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni"))
      best = kVnni;
    const char* aten = std::getenv("ATEN_CPU_CAPABILITY");
    if (aten != nullptr && std::string(aten) == "avx2" && best > kAvx2) best = kAvx2;
    if (aten != nullptr && std::string(aten) == "default") best = kNone;
    const char* cap = std::getenv("MINIGPT_W8A8_ISA");
    if (cap != nullptr && std::string(cap) == "avx2" && best > kAvx2) best = kAvx2;
    return best;
  }();
  return chosen;
}

bool available() { return isa() != kNone; }

const char* isa_name() { return isa() == kVnni ? "avx512_vnni" : isa() == kAvx2 ? "avx2" : "fbgemm"; }

// Round `rows` rows of x ([rows, in]) to int8 into q ([rows, padded], padded = in rounded up to 64, zeros after
// `in`), each row's sum into sum and whether the row holds a -128 into low (1 or 0): FBGEMM's steps, vectorised as
// it vectorises them. Why low is noted here: the AVX2 product must know it per pass (rows_avx2_bytes), and the
// quantizer, which writes each byte once, sees it at no cost, where a scan in `product` ran on every thread.
__attribute__((target("avx512f,avx512bw"))) void quantize_avx512(const float* x, int64_t rows, int64_t in,
                                                                  int64_t padded, int8_t* q, int32_t* sum,
                                                                  uint8_t* low) {
  const __m512 zero_point = _mm512_set1_ps(128.0f), top = _mm512_set1_ps(255.0f), bottom = _mm512_setzero_ps();
  const __m512i lowest = _mm512_set1_epi32(-128);
  for (int64_t m = 0; m < rows; ++m) {
    __m512i s = _mm512_setzero_si512();
    __mmask16 seen = 0;
    for (int64_t k = 0; k < padded; k += 16) {
      // past `in`: x = 0, q = 0
      __mmask16 live = in - k >= 16 ? 0xFFFF : in > k ? static_cast<__mmask16>((1u << (in - k)) - 1) : 0;
      __m512 t = _mm512_add_ps(_mm512_maskz_loadu_ps(live, x + m * in + k), zero_point);  // rounded, as FBGEMM's FMA
      t = _mm512_max_ps(_mm512_min_ps(t, top), bottom);  // min(NaN, 255) is 255, as FBGEMM's min(NaN, limit)
      __m512i r = _mm512_sub_epi32(_mm512_cvtps_epi32(t), _mm512_set1_epi32(128));  // ties to even
      s = _mm512_add_epi32(s, r);
      seen |= _mm512_cmpeq_epi32_mask(r, lowest);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * padded + k), _mm512_cvtepi32_epi8(r));
    }
    sum[m] = _mm512_reduce_add_epi32(s);
    low[m] = seen != 0;
  }
}

// The sum of the eight int32 lanes of v.
__attribute__((target("avx2"))) inline int32_t sum_lanes(__m256i v) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  return _mm_cvtsi128_si32(h);
}

// The same numbers with AVX2: eight floats at a time, four vectors of int32 narrowed to 32 bytes by saturating
// packs (exact: every value lies in -128..127) and put back in order across the two 128-bit lanes.
__attribute__((target("avx2"))) void quantize_avx2(const float* x, int64_t rows, int64_t in, int64_t padded,
                                                   int8_t* q, int32_t* sum, uint8_t* low) {
  const __m256 zero_point = _mm256_set1_ps(128.0f), top = _mm256_set1_ps(255.0f), bottom = _mm256_setzero_ps();
  const __m256i offset = _mm256_set1_epi32(128), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i lowest = _mm256_set1_epi32(-128);
  for (int64_t m = 0; m < rows; ++m) {
    __m256i s = _mm256_setzero_si256(), seen = _mm256_setzero_si256();
    for (int64_t k = 0; k < padded; k += 32) {
      __m256i r[4];
      for (int j = 0; j < 4; ++j) {
        const int64_t at = k + 8 * j, live = in - at >= 8 ? 8 : in > at ? in - at : 0;  // past `in`: x = 0, q = 0
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(live)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 t = _mm256_add_ps(_mm256_maskload_ps(x + m * in + (live ? at : 0), mask), zero_point);
        t = _mm256_max_ps(_mm256_min_ps(t, top), bottom);  // min(NaN, 255) is 255, as FBGEMM's min(NaN, limit)
        r[j] = _mm256_sub_epi32(_mm256_cvtps_epi32(t), offset);  // ties to even
        s = _mm256_add_epi32(s, r[j]);
        seen = _mm256_or_si256(seen, _mm256_cmpeq_epi32(r[j], lowest));
      }
      __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + m * padded + k), _mm256_permutevar8x32_epi32(bytes, order));
    }
    sum[m] = sum_lanes(s);
    low[m] = !_mm256_testz_si256(seen, seen);
  }
}

void quantize(const float* x, int64_t rows, int64_t in, int64_t padded, int8_t* q, int32_t* sum, uint8_t* low) {
  if (isa() == kVnni)
    quantize_avx512(x, rows, in, padded, q, sum, low);
  else
    quantize_avx2(x, rows, in, padded, q, sum, low);
}

// Output rows [n0, n1) for M activation rows: y[m * ldy + n].
template <int M>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void rows_vnni(const int8_t* q, const int32_t* qsum,
                                                                      int64_t padded, const int8_t* w, int64_t in,
                                                                      const float* scale, int64_t n0, int64_t n1,
                                                                      float* y, int64_t ldy) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t full = in / 64, tail = in % 64;
  const __mmask64 tail_mask = tail ? (~0ULL >> (64 - tail)) : 0;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * in;
    __m512i acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_si512();
    for (int64_t c = 0; c <= full; ++c) {
      if (c == full && tail == 0) break;
      _mm_prefetch(reinterpret_cast<const char*>(row + 64 * c) + kPrefetch, _MM_HINT_T0);
      __m512i v = c < full ? _mm512_loadu_si512(row + 64 * c) : _mm512_maskz_loadu_epi8(tail_mask, row + 64 * c);
      v = _mm512_xor_si512(v, flip);  // w + 128, unsigned; past `in` the activations are 0
      for (int m = 0; m < M; ++m) acc[m] = _mm512_dpbusd_epi32(acc[m], v, _mm512_loadu_si512(q + m * padded + 64 * c));
    }
    for (int m = 0; m < M; ++m)
      y[m * ldy + n] = static_cast<float>(_mm512_reduce_add_epi32(acc[m]) - 128 * qsum[m]) * scale[n];
  }
}

// Sixteen int8 values at p, widened to int16.
__attribute__((target("avx2"))) inline __m256i widen(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// AVX2 has no byte dot product that cannot saturate on every pair of int8 values (`vpmaddubsw` adds pairs in 16 bits:
// 2 x 255 x 127 > 32767, why FBGEMM's AVX2 product is not exact), so here both operands are widened to 16 bits
// (`vpmovsxbw`) and multiplied with `vpmaddwd`, pairs summed into int32: exact for every pair, and signed x signed, so
// no offset. The path of passes with an activation of -128; rows_avx2_bytes below takes the others. 32 inputs per
// iteration (two 16-input halves), weight rows in turn as above; a row's eight lanes summed at its
// end, inputs past the last multiple of 32 one by one.
template <int M>
__attribute__((target("avx2"))) void rows_avx2(const int8_t* q, const int32_t* qsum, int64_t padded, const int8_t* w,
                                               int64_t in, const float* scale, int64_t n0, int64_t n1, float* y,
                                               int64_t ldy) {
  (void)qsum;
  const int64_t full = in / 32 * 32;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * in;
    __m256i acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
    for (int64_t k = 0; k < full; k += 32) {
      if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetch, _MM_HINT_T0);
      const __m256i wa = widen(row + k), wb = widen(row + k + 16);
      for (int m = 0; m < M; ++m) {
        const __m256i qa = widen(q + m * padded + k), qb = widen(q + m * padded + k + 16);
        acc[m] = _mm256_add_epi32(acc[m], _mm256_add_epi32(_mm256_madd_epi16(wa, qa), _mm256_madd_epi16(wb, qb)));
      }
    }
    for (int m = 0; m < M; ++m) {
      int32_t total = sum_lanes(acc[m]);
      for (int64_t k = full; k < in; ++k) total += static_cast<int32_t>(q[m * padded + k]) * row[k];
      y[m * ldy + n] = static_cast<float>(total) * scale[n];
    }
  }
}

// Bytes ahead of the weight read to prefetch on the byte-product path below. Measured on the 2-core AVX2-only Zen 3
// EPYC (family 25 model 1) in a standalone copy over TinyLlama-1.1B's 88 layer matrices (969 MB), one activation row,
// 2 threads, the variants alternating (session 70, medians of 20 paired ratios to rows_avx2 with its 4 KB): 1 KB ahead
// 1.11x (1.07x in a second series of 30), 768 bytes 1.08x, none 1.03x, 4 KB into L2 0.96x; a plain sum of the same
// bytes 1.13x (1.12x).
constexpr std::uintptr_t kPrefetchBytes = 1024;

// The same exact sums with `vpmaddubsw` (unsigned x signed bytes, pairs added in 16 bits) where no activation of the
// pass is -128: |w| is the unsigned side (0..128, 128 for -128 read as unsigned), q with w's sign the signed side
// (`vpsignb`: -127..127 while q > -128), so a pair's sum is at most 2 x 128 x 127 = 32512 in size, below 32767;
// `vpmaddwd` by ones adds the pairs into int32. 64 bytes of weights take two loads, two `vpsignb` for |w| and two
// `vpsignb`, `vpmaddubsw`, `vpmaddwd`, `vpaddd` per activation row, where rows_avx2 widens all four 16-byte halves
// first. Why: on the Zen 3 above it streams the int8 matrices at 1.07-1.11x rows_avx2's rate (kPrefetchBytes), 0.98x
// a plain read of them. An activation of -128 (an input at or below -127.5 x its row's scale, which w8a8_linear's
// scaling never makes: it divides by max|x| / 127) would lose its sign there, so such a pass takes rows_avx2.
template <int M>
__attribute__((target("avx2"))) inline void bytes_step(const int8_t* q, int64_t padded, const int8_t* w, __m256i ones,
                                                       __m256i (&acc)[M][2], int chain) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i mag = _mm256_sign_epi8(wv, wv);
  for (int m = 0; m < M; ++m) {
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + m * padded));
    const __m256i pairs = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(qv, wv));  // w x q, two by two
    acc[m][chain] = _mm256_add_epi32(acc[m][chain], _mm256_madd_epi16(pairs, ones));
  }
}

template <int M>
__attribute__((target("avx2"))) void rows_avx2_bytes(const int8_t* q, const int32_t* qsum, int64_t padded,
                                                     const int8_t* w, int64_t in, const float* scale, int64_t n0,
                                                     int64_t n1, float* y, int64_t ldy) {
  (void)qsum;
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t wide = in / 64 * 64, full = in / 32 * 32;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * in;
    __m256i acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k < wide; k += 64) {
      // an integer address: the line ahead may lie past the matrix, where no pointer may point
      _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<std::uintptr_t>(row + k) + kPrefetchBytes),
                   _MM_HINT_T0);
      bytes_step<M>(q + k, padded, row + k, ones, acc, 0);
      bytes_step<M>(q + k + 32, padded, row + k + 32, ones, acc, 1);
    }
    if (k < full) bytes_step<M>(q + k, padded, row + k, ones, acc, 0);
    for (int m = 0; m < M; ++m) {
      int32_t total = sum_lanes(_mm256_add_epi32(acc[m][0], acc[m][1]));
      for (int64_t k = full; k < in; ++k) total += static_cast<int32_t>(q[m * padded + k]) * row[k];
      y[m * ldy + n] = static_cast<float>(total) * scale[n];
    }
  }
}

// Output rows [n0, n1) of the product (y[m * ldy + n]) for `rows` activation rows, q, qsum and low from quantize,
// kMaxRows activation rows per pass over the weights. More rows than one pass takes (a prompt): the weights a block of
// kBlockRows rows at a time, every pass over one block before the next, so that the block stays in cache while the
// activations stream past, where a pass over all of [n0, n1) for each kMaxRows rows would read the matrix from
// memory rows / kMaxRows times.
void product(const int8_t* q, const int32_t* qsum, const uint8_t* low, int64_t rows, int64_t padded, const int8_t* w,
             int64_t in, const float* scale, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  using Pass = void (*)(const int8_t*, const int32_t*, int64_t, const int8_t*, int64_t, const float*, int64_t,
                        int64_t, float*, int64_t);
  static const Pass vnni[kMaxRows] = {rows_vnni<1>, rows_vnni<2>, rows_vnni<3>, rows_vnni<4>};
  static const Pass avx2[kMaxRows] = {rows_avx2<1>, rows_avx2<2>, rows_avx2<3>, rows_avx2<4>};
  static const Pass bytes[kMaxRows] = {rows_avx2_bytes<1>, rows_avx2_bytes<2>, rows_avx2_bytes<3>,
                                       rows_avx2_bytes<4>};
  std::vector<Pass> passes;  // one per kMaxRows activation rows
  for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
    const int64_t n = std::min<int64_t>(kMaxRows, rows - m0);
    const Pass* table = vnni;
    if (isa() != kVnni)  // an activation of -128 in the pass: rows_avx2_bytes would get its sign wrong
      table = std::any_of(low + m0, low + m0 + n, [](uint8_t v) { return v != 0; }) ? avx2 : bytes;
    passes.push_back(table[n - 1]);
  }
  const int64_t block = rows <= kMaxRows ? n1 - n0 : kBlockRows;
  for (int64_t b0 = n0; b0 < n1; b0 += block) {
    const int64_t b1 = std::min(n1, b0 + block);
    for (int64_t m0 = 0, g = 0; m0 < rows; m0 += kMaxRows, ++g)
      passes[g](q + m0 * padded, qsum + m0, padded, w, in, scale, b0, b1, y + m0 * ldy, ldy);
  }
}

}  // namespace minigpt_w8a8
