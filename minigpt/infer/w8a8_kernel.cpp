// MiniGPT's own int8 x int8 product for a few activation rows (decode steps): the kernel the op minigpt::w8a8_mm
// (native_runner.cpp) uses for up to kMaxRows rows on a CPU with AVX512-VNNI, in place of FBGEMM's. It reads the
// int8 matrix as it lies in memory, row by row, so nothing has to be repacked when a bundle is opened: FBGEMM's
// packing of SmolLM-135M's int8 matrices took 0.5-0.75 s of a ~2 s one-shot CLI call (docs/benchmarks.md).
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
// subtracted at the end. Four weight rows share each 64-byte load of an activation row; a row's 16 lanes are summed
// once, at its end. No torch headers here: the threads come from the caller (native_runner.cpp).
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace minigpt_w8a8 {

constexpr int kMaxRows = 4;       // activation rows sharing one pass over the weights
constexpr int kOutRows = 4;       // weight rows per pass (8 for one or two activation rows: no faster, measured)
// Bytes ahead of each weight row's read to prefetch; without, the product ran no faster than FBGEMM's (SmolLM-135M's
// 120 layer matrices, one row, 2 threads, Xeon model 207: 1.00x FBGEMM; 4 KB 1.44x, 8 KB 1.52x, 16 KB 1.44x).
constexpr int64_t kPrefetch = 8192;

// Whether this kernel runs here: AVX512-VNNI (and BW for the byte loads), unless $MINIGPT_W8A8_KERNEL=fbgemm keeps
// FBGEMM for every call (A/B measurements). Read once.
bool available() {
  static const bool ok = [] {
    __builtin_cpu_init();
    const char* choice = std::getenv("MINIGPT_W8A8_KERNEL");
    if (choice != nullptr && std::string(choice) == "fbgemm") return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return ok;
}

// Round `rows` rows of x ([rows, in]) to int8 into q ([rows, padded], padded = in rounded up to 64, zeros after
// `in`) and each row's sum into sum: FBGEMM's steps, vectorised as it vectorises them.
__attribute__((target("avx512f,avx512bw"))) void quantize(const float* x, int64_t rows, int64_t in, int64_t padded,
                                                           int8_t* q, int32_t* sum) {
  const __m512 zero_point = _mm512_set1_ps(128.0f), top = _mm512_set1_ps(255.0f), bottom = _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    __m512i s = _mm512_setzero_si512();
    for (int64_t k = 0; k < padded; k += 16) {
      // past `in`: x = 0, q = 0
      __mmask16 live = in - k >= 16 ? 0xFFFF : in > k ? static_cast<__mmask16>((1u << (in - k)) - 1) : 0;
      __m512 t = _mm512_add_ps(_mm512_maskz_loadu_ps(live, x + m * in + k), zero_point);  // rounded, as FBGEMM's FMA
      t = _mm512_max_ps(_mm512_min_ps(t, top), bottom);  // min(NaN, 255) is 255, as FBGEMM's min(NaN, limit)
      __m512i r = _mm512_sub_epi32(_mm512_cvtps_epi32(t), _mm512_set1_epi32(128));  // ties to even
      s = _mm512_add_epi32(s, r);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * padded + k), _mm512_cvtepi32_epi8(r));
    }
    sum[m] = _mm512_reduce_add_epi32(s);
  }
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
  for (int64_t n = n0; n < n1; n += kOutRows) {
    const int R = static_cast<int>(n1 - n < kOutRows ? n1 - n : kOutRows);
    __m512i acc[M][kOutRows];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < kOutRows; ++r) acc[m][r] = _mm512_setzero_si512();
    const int8_t* row[kOutRows];
    for (int r = 0; r < kOutRows; ++r) row[r] = w + (n + (r < R ? r : 0)) * in;
    for (int64_t c = 0; c <= full; ++c) {
      if (c == full && tail == 0) break;
      __m512i wv[kOutRows];
      for (int r = 0; r < kOutRows; ++r) {
        if (r >= R) {
          wv[r] = _mm512_setzero_si512();
          continue;
        }
        _mm_prefetch(reinterpret_cast<const char*>(row[r] + 64 * c) + kPrefetch, _MM_HINT_T0);
        __m512i v = c < full ? _mm512_loadu_si512(row[r] + 64 * c) : _mm512_maskz_loadu_epi8(tail_mask, row[r] + 64 * c);
        wv[r] = _mm512_xor_si512(v, flip);  // w + 128, unsigned; past `in` the activations are 0
      }
      for (int m = 0; m < M; ++m) {
        __m512i qv = _mm512_loadu_si512(q + m * padded + 64 * c);
        for (int r = 0; r < kOutRows; ++r) acc[m][r] = _mm512_dpbusd_epi32(acc[m][r], wv[r], qv);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) {
        int32_t total = _mm512_reduce_add_epi32(acc[m][r]) - 128 * qsum[m];
        y[m * ldy + n + r] = static_cast<float>(total) * scale[n + r];
      }
  }
}

// Output rows [n0, n1) of the product (y[m * ldy + n]) for `rows` activation rows, q and qsum from quantize, kMaxRows
// activation rows per pass over the weights.
void product(const int8_t* q, const int32_t* qsum, int64_t rows, int64_t padded, const int8_t* w, int64_t in,
             const float* scale, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  using Pass = void (*)(const int8_t*, const int32_t*, int64_t, const int8_t*, int64_t, const float*, int64_t,
                        int64_t, float*, int64_t);
  static const Pass passes[kMaxRows] = {rows_vnni<1>, rows_vnni<2>, rows_vnni<3>, rows_vnni<4>};
  for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
    int64_t n = rows - m0 < kMaxRows ? rows - m0 : kMaxRows;
    passes[n - 1](q + m0 * padded, qsum + m0, padded, w, in, scale, n0, n1, y + m0 * ldy, ldy);
  }
}

}  // namespace minigpt_w8a8
