// MiniGPT's weight-only int8 product: float32 activations times an int8 matrix with per-row scales, the CPU kernel of
// the op minigpt::woq8_mm(x, words, scale). Its one user is the int8 screen of a float LM head in greedy decode
// steps (minigpt/infer/fastpath/screen.py), whose error bound assumes float32 activations: unlike the int8 x int8
// kernels (w8a8_kernel.cpp, q4_kernel.cpp) nothing is rounded to 8 bits here. Built into the native runner library
// (native_runner.cpp, whose build compiles this file beside it), registered in a Python process by mg_woq8_install,
// in the runner's own process when it opens a bundle.
//
// What it computes:
//   x      [rows, in] float32;
//   words  [out, in / 4] float32: the int8 matrix's bytes as float32 words, as the compiled step's generated loops
//          read them (minigpt/infer/fastpath/kernels.py, int8_words): byte j of word m of a row is the row's input
//          4 m + j; the bytes are read as int8, the words never as floats;
//   scale  [out] float32, per output row;
//   y[m, n] = scale[n] * sum_k x[m, k] * float(w[n, k]): every weight converted to float32 exactly, the products
//          accumulated in float32 by fused multiply-adds, in four chains of 16 (AVX-512) or 8 (AVX2) lanes summed
//          at the row's end. The order of the sum differs from the generated loops'; the screen's bound covers any
//          order
//          (screen.py: dim 2^-24 ||h|| ||s q||, Higham's bound for a dot product).
//
// Why: Inductor's loops unpack each byte from its float32 word with two shifts and a conversion; with the 256-bit
// vectors MiniGPT's compiled step uses on AVX-512 CPUs (fastpath/step.py, simd_options) they read SmolLM-135M's
// 28 MB screen at ~9 GB/s, a seventh of a float32 decode step's time (docs/benchmarks.md). Here one
// `vpmovsxbd` widens 16 (AVX-512) or 8 (AVX2) bytes from memory to int32 and one `vcvtdq2ps` makes them floats.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "runner_ops.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

namespace {

using minigpt_ops::kAvx2;
using minigpt_ops::kAvx512;
using minigpt_ops::kScalar;

constexpr int kMaxRows = 2;  // activation rows per pass over the weights
// Bytes ahead of the weight read to prefetch, as in the int8 x int8 kernel (w8a8_kernel.cpp). The weight rows are
// read one after another, each from its start to its end, as there: one sequential stream (four rows side by side,
// before session 56, streamed at 18-20 GB/s on a Zen 4 EPYC against 30-37 for rows in turn). Each row's sum is the
// same either way: its own lanes, in the same order.
constexpr int64_t kPrefetch = 4096;

// This CPU's best path, capped by $ATEN_CPU_CAPABILITY and $MINIGPT_WOQ8_ISA (minigpt_ops::float_isa); read once.
minigpt_ops::FloatIsa chosen_isa() {
  static const minigpt_ops::FloatIsa isa = minigpt_ops::float_isa("MINIGPT_WOQ8_ISA");
  return isa;
}

// Output rows [n0, n1) for M activation rows: y[m * ldy + n]. Four chains of fused multiply-adds per activation
// row (kChains), summed at the row's end, so that the adds' latency does not bound the loop: with one chain a row of
// 576 inputs waits 36 (AVX-512) or 72 (AVX2) times for the previous FMA, which on a 2-core AVX2-only Zen 3 EPYC
// kept the 28 MB screen of SmolLM-135M at 11 GB/s (docs/benchmarks.md, session 67).
constexpr int kChains = 4;

template <int M>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void rows_avx512(const float* x, const int8_t* w, int64_t in,
                                                                      const float* scale, int64_t n0, int64_t n1,
                                                                      float* y, int64_t ldy) {
  const int64_t wide = in / 64 * 64, full = in / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (in - full)) - 1);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * in;
    __m512 acc[M][kChains];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < kChains; ++c) acc[m][c] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < wide; k += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetch, _MM_HINT_T0);
      for (int c = 0; c < kChains; ++c) {
        const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k + 16 * c))));
        for (int m = 0; m < M; ++m)
          acc[m][c] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * in + k + 16 * c), wv, acc[m][c]);
      }
    }
    for (; k < full; k += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
      for (int m = 0; m < M; ++m) acc[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * in + k), wv, acc[m][0]);
    }
    if (tail) {
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail, row + full)));
      for (int m = 0; m < M; ++m)
        acc[m][1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x + m * in + full), wv, acc[m][1]);
    }
    for (int m = 0; m < M; ++m) {
      const __m512 s = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
      y[m * ldy + n] = _mm512_reduce_add_ps(s) * scale[n];
    }
  }
}

// The sum of the eight float lanes of v.
__attribute__((target("avx2,fma"))) inline float sum_lanes(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

template <int M>
__attribute__((target("avx2,fma"))) void rows_avx2(const float* x, const int8_t* w, int64_t in, const float* scale,
                                                   int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t wide = in / 32 * 32, full = in / 8 * 8;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = w + n * in;
    __m256 acc[M][kChains];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < kChains; ++c) acc[m][c] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k < wide; k += 32) {
      if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetch, _MM_HINT_T0);
      for (int c = 0; c < kChains; ++c) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k + 8 * c));
        const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        for (int m = 0; m < M; ++m)
          acc[m][c] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * in + k + 8 * c), wv, acc[m][c]);
      }
    }
    for (; k < full; k += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k));
      const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
      for (int m = 0; m < M; ++m) acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * in + k), wv, acc[m][0]);
    }
    for (int m = 0; m < M; ++m) {
      float total = sum_lanes(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3])));
      for (int64_t j = full; j < in; ++j) total = std::fma(x[m * in + j], static_cast<float>(row[j]), total);
      y[m * ldy + n] = total * scale[n];
    }
  }
}

template <int M>
void rows_scalar(const float* x, const int8_t* w, int64_t in, const float* scale, int64_t n0, int64_t n1, float* y,
                 int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n)
    for (int m = 0; m < M; ++m) {
      float total = 0.0f;
      for (int64_t k = 0; k < in; ++k) total = std::fma(x[m * in + k], static_cast<float>(w[n * in + k]), total);
      y[m * ldy + n] = total * scale[n];
    }
}

at::Tensor woq8_mm(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "minigpt::woq8_mm: x must be float32 [rows, in]");
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == at::kFloat && words.size(1) * 4 == x.size(1),
              "minigpt::woq8_mm: words must be float32 [out, ", x.size(1) / 4, "] (an int8 matrix's bytes)");
  TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == at::kFloat && scale.size(0) == words.size(0),
              "minigpt::woq8_mm: scale must be float32 [", words.size(0), "]");
  TORCH_CHECK(x.device().is_cpu() && words.device().is_cpu() && scale.device().is_cpu(),
              "minigpt::woq8_mm: CPU tensors only");
  at::Tensor xc = x.contiguous(), wc = words.contiguous(), sc = scale.contiguous();
  const int64_t rows = xc.size(0), in = xc.size(1), out = wc.size(0);
  at::Tensor y = at::empty({rows, out}, xc.options());
  if (rows == 0 || out == 0) return y;
  using Pass = void (*)(const float*, const int8_t*, int64_t, const float*, int64_t, int64_t, float*, int64_t);
  static const Pass avx512[kMaxRows] = {rows_avx512<1>, rows_avx512<2>}, avx2[kMaxRows] = {rows_avx2<1>, rows_avx2<2>},
                    scalar[kMaxRows] = {rows_scalar<1>, rows_scalar<2>};
  const Pass* passes = chosen_isa() == kAvx512 ? avx512 : chosen_isa() == kAvx2 ? avx2 : scalar;
  const float* xp = xc.data_ptr<float>();
  const int8_t* w = reinterpret_cast<const int8_t*>(wc.data_ptr<float>());
  const float* s = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (out + 15) / 16, 1, [&](int64_t begin, int64_t end) {  // in units of 16 rows
    const int64_t n0 = begin * 16, n1 = std::min(out, end * 16);
    for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
      const int64_t m = std::min<int64_t>(kMaxRows, rows - m0);
      passes[m - 1](xp + m0 * in, w, in, s, n0, n1, yp + m0 * out, out);
    }
  });
  return y;
}

std::string woq8_isa() { return minigpt_ops::kFloatIsaNames[chosen_isa()]; }

minigpt_ops::Registration registration;

void register_woq8_op() {
  minigpt_ops::register_once(registration, "minigpt::woq8_mm", [](torch::Library& def, bool define,
                                                                  torch::Library& impl) {
    if (define) def.def("woq8_mm(Tensor x, Tensor words, Tensor scale) -> Tensor");
    def.def("woq8_isa() -> str", TORCH_FN(woq8_isa));
    impl.impl("woq8_mm", TORCH_FN(woq8_mm));
  });
}

}  // namespace

extern "C" {

// The C++ kernel of minigpt::woq8_mm for this process (a Python process, or the runner before it loads a package
// that calls the op). Returns 0, or -1 with the reason in `err`.
int mg_woq8_install(char* err, int errlen) { return minigpt_ops::report(register_woq8_op, err, errlen); }

}  // extern "C"
