// MiniGPT's int4 x int8 matrix product for decode steps: the CPU kernel of the op minigpt::q4_mm(x, weight, scale)
// (and of minigpt::q4_dequant, int4 weights as float for prefill, below q4_mm),
// built into the native runner library (minigpt/infer/native_runner.cpp, whose build compiles this file beside it)
// and registered in a Python process by mg_q4_install, in the runner's own process when it opens a bundle.
//
// What it computes (the layout is written by minigpt/infer/fastpath/library.py, q4_layout):
//   x       [rows, in] float32 activations, quantized here group by group as llama.cpp's Q8_0 does
//           (ggml-quants.c, quantize_row_q8_0_ref: d = max|x| / 127, q = round(x / d)), d kept in float32;
//   weight  [out / 16, in / 8, 64] uint8: the int4 levels (0..15) of Q4_0 (value = (level - 8) * scale), 16 output
//           rows by 8 inputs per 64 bytes: byte 4 i + j of chunk c holds row i's level of input 8 c + j in its low
//           nibble and of input 8 c + 4 + j in its high nibble;
//   scale   [out / 16, in / group, 16] float16: each group's scale, the 16 rows of a block side by side;
//   result  [rows, out] float32: y[m, n] = sum over groups g of (s[n, g] * d[m, g]) * sum_k (level - 8) * q[m, k],
//           the integer sums exact (int32), the groups accumulated in order by fused multiply-adds.
//
// Why this layout: each 32-bit lane of a vector register then belongs to one output row and takes four of its
// weights, so one `vpdpbusd` (AVX512-VNNI: unsigned bytes x signed bytes, four products summed into each int32
// lane) multiplies 16 rows by 4 inputs with the four activation bytes broadcast, and nothing is summed across lanes
// (llama.cpp's repacked Q4_0 layouts, ggml-cpu/repack.cpp, interleave rows for the same reason). Three paths give
// the same integers and the same floats, bit for bit: AVX512-VNNI, AVX2 (`vpmaddubsw` + `vpmaddwd`: the 16-bit sums
// stay below 2^15, no saturation; block_avx2) and plain C++; MINIGPT_Q4_ISA=avx2|scalar caps the choice (tests, A/B).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
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
#include <vector>

namespace {

constexpr int64_t kRows = 16;   // output rows per block
constexpr int64_t kBlock = 64;  // bytes per block and chunk of 8 inputs
constexpr int kMaxRows = 4;     // activation rows sharing one pass over a block's weights
// Bytes ahead of the weight read to prefetch. A decode step's matrices come from memory, not cache, and the
// hardware prefetcher alone left the product latency-bound: SmolLM-135M's 120 layer matrices (60 MB, 2 threads,
// Xeon model 207) streamed at 7-11 GB/s without, 11-14 GB/s at 8 KB (4 KB 13, 16 KB 12.5, 32 KB 7-11).
constexpr int64_t kPrefetch = 8192;

struct Quantized {
  std::vector<int8_t> q;     // [rows, in]
  std::vector<float> d;      // [rows, groups]
  std::vector<int32_t> sum;  // [rows, groups]: sum of q over the group, for the levels' offset of 8
};

// One group of x (`group` values) rounded to int8 as llama.cpp's Q8_0: d = max|x| / 127 (NaN when the group holds a
// NaN), q = round-half-even(x / d) through the same float32 multiply by 1 / d; returns d, q's sum in *sum.
inline float quantize_group(const float* xs, int64_t group, int8_t* q, int32_t* sum) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t k = 0; k < group; ++k) {
    amax = std::max(amax, std::fabs(xs[k]));
    nan = nan || std::isnan(xs[k]);
  }
  float d = nan ? NAN : amax / 127.0f;  // std::max drops a NaN; the group's products must not
  float id = (d != 0.0f && std::isfinite(d)) ? 1.0f / d : 0.0f;  // a non-finite d reaches the output
  int32_t s = 0;
  for (int64_t k = 0; k < group; ++k) {
    const float r = xs[k] * id;  // NaN only in a NaN group (id 0 there), whose d is NaN: its q does not matter
    q[k] = std::isnan(r) ? 0 : static_cast<int8_t>(std::nearbyint(r));  // ties to even, as torch.round
    s += q[k];
  }
  *sum = s;
  return d;
}

// The same numbers eight values at a time (group a multiple of 8): the maximum is exact in any order, the products
// are the same float32 multiplies, and vroundps rounds half to even as nearbyint does in the default mode. Why: the
// scalar loop calls libm's nearbyintf once per value, on the calling thread while the others wait: SmolLM-135M's
// int4 decode took 5.91 ms a token with it, 4.65-4.81 ms with this, on a 2-core Zen 3 EPYC (120 products a token;
// separate processes, docs/benchmarks.md, session 67).
__attribute__((target("avx2,fma"))) float quantize_group_avx2(const float* xs, int64_t group, int8_t* q,
                                                              int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
  for (int64_t k = 0; k < group; k += 8) {
    const __m256 v = _mm256_loadu_ps(xs + k);
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float d = _mm256_movemask_ps(unordered) ? NAN : amax / 127.0f;
  const float id = (d != 0.0f && std::isfinite(d)) ? 1.0f / d : 0.0f;
  const __m256 vid = _mm256_set1_ps(id);
  __m256i s = _mm256_setzero_si256();
  for (int64_t k = 0; k < group; k += 8) {
    const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(xs + k), vid);
    const __m256 r = _mm256_andnot_ps(_mm256_cmp_ps(p, p, _CMP_UNORD_Q),  // NaN -> 0, as quantize_group
                                      _mm256_round_ps(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i i = _mm256_cvtps_epi32(r);  // exact: an integer in -127..127
    s = _mm256_add_epi32(s, i);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(w, w));
  }
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  *sum = _mm_cvtsi128_si32(h);
  return d;
}

void quantize(const float* x, int64_t rows, int64_t in, int64_t group, bool vector, Quantized& out) {
  int64_t groups = in / group;
  out.q.resize(rows * in);
  out.d.resize(rows * groups);
  out.sum.resize(rows * groups);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xs = x + m * in + g * group;
      int8_t* q = out.q.data() + m * in + g * group;
      int32_t* sum = out.sum.data() + m * groups + g;
      out.d[m * groups + g] = vector && group % 8 == 0 ? quantize_group_avx2(xs, group, q, sum)
                                                       : quantize_group(xs, group, q, sum);
    }
}

// One block of 16 output rows for M activation rows. w: the block's [in / 8, 64] bytes; s: its [groups, 16] scales;
// y: row m's 16 outputs at y + m * ldy.
struct Args {
  const uint8_t* w;
  const c10::Half* s;
  const int8_t* q;
  const float* d;
  const int32_t* sum;
  int64_t in, groups, chunks;  // chunks of 8 inputs per group
  float* y;
  int64_t ldy;
};

inline int32_t four(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

template <int M>
void block_scalar(const Args& a) {
  for (int64_t i = 0; i < kRows; ++i) {
    for (int m = 0; m < M; ++m) {
      const int8_t* q = a.q + m * a.in;
      float acc = 0.0f;
      for (int64_t g = 0; g < a.groups; ++g) {
        int32_t isum = -8 * a.sum[m * a.groups + g];
        for (int64_t c = 0; c < a.chunks; ++c) {
          int64_t chunk = g * a.chunks + c;
          const uint8_t* b = a.w + chunk * kBlock + 4 * i;
          for (int j = 0; j < 4; ++j)
            isum += (b[j] & 15) * q[8 * chunk + j] + (b[j] >> 4) * q[8 * chunk + 4 + j];
        }
        float f = static_cast<float>(a.s[g * kRows + i]) * a.d[m * a.groups + g];
        acc = std::fma(static_cast<float>(isum), f, acc);
      }
      a.y[m * a.ldy + i] = acc;
    }
  }
}

// AVX2: `vpmaddubsw` multiplies 32 unsigned levels by 32 signed activation bytes and adds adjacent pairs into 16-bit
// lanes (|pair| <= 2 x 15 x 127 = 3810), and the pairs of up to kSum16 chunks are added in 16 bits (|sum| <= 2 x 4 x
// 3810 = 30480 < 32767: exact) before one `vpmaddwd` by ones widens them to the 32-bit sums of each row. Adding
// the pairs in 16 bits, not widening every chunk, and (for up to two activation rows) both halves of a block in one
// pass, sharing the activation broadcasts: SmolLM-135M's 120 layer matrices, one row, 2 threads, on a 2-core
// AVX2-only Zen 3 EPYC: 3.0-3.6 -> 2.3-3.2 ms a pass (docs/benchmarks.md, session 67). The integers are the same,
// and so are the floats: each group's sum meets its scale in the same fused multiply-add as before.
constexpr int64_t kSum16 = 4;

template <int M>
__attribute__((target("avx2,f16c,fma"))) void block_avx2(const Args& a) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  if constexpr (M <= 2) {  // both halves in one pass: 2 x M 16-bit and 2 x M float accumulators fit the registers
    __m256 acc[2][M];
    for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_ps();
    const uint8_t* w = a.w;
    for (int64_t g = 0; g < a.groups; ++g) {
      __m256i isum[2][M];
      for (int m = 0; m < M; ++m) isum[0][m] = isum[1][m] = _mm256_set1_epi32(-8 * a.sum[m * a.groups + g]);
      for (int64_t c0 = 0; c0 < a.chunks; c0 += kSum16) {
        __m256i s16[2][M];
        for (int m = 0; m < M; ++m) s16[0][m] = s16[1][m] = _mm256_setzero_si256();
        for (int64_t c = c0; c < std::min(a.chunks, c0 + kSum16); ++c, w += kBlock) {
          _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch, _MM_HINT_T0);
          __m256i lo[2], hi[2];
          for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * h));
            lo[h] = _mm256_and_si256(v, nibble);
            hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
          }
          for (int m = 0; m < M; ++m) {
            const int8_t* q = a.q + m * a.in + 8 * (g * a.chunks + c);
            const __m256i ql = _mm256_set1_epi32(four(q)), qh = _mm256_set1_epi32(four(q + 4));
            for (int h = 0; h < 2; ++h)
              s16[h][m] = _mm256_add_epi16(s16[h][m], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], ql),
                                                                       _mm256_maddubs_epi16(hi[h], qh)));
          }
        }
        for (int h = 0; h < 2; ++h)
          for (int m = 0; m < M; ++m) isum[h][m] = _mm256_add_epi32(isum[h][m], _mm256_madd_epi16(s16[h][m], ones));
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 scale =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.s + g * kRows + 8 * h)));
        for (int m = 0; m < M; ++m) {
          const __m256 f = _mm256_mul_ps(scale, _mm256_set1_ps(a.d[m * a.groups + g]));
          acc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h][m]), f, acc[h][m]);
        }
      }
    }
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < M; ++m) _mm256_storeu_ps(a.y + m * a.ldy + 8 * h, acc[h][m]);
    return;
  }
  for (int64_t half = 0; half < 2; ++half) {  // rows 0-7, then 8-15: the second 32 bytes of every chunk
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    const uint8_t* w = a.w + 32 * half;
    for (int64_t g = 0; g < a.groups; ++g) {
      __m256i isum[M];
      for (int m = 0; m < M; ++m) isum[m] = _mm256_set1_epi32(-8 * a.sum[m * a.groups + g]);
      for (int64_t c0 = 0; c0 < a.chunks; c0 += kSum16) {
        __m256i s16[M];
        for (int m = 0; m < M; ++m) s16[m] = _mm256_setzero_si256();
        for (int64_t c = c0; c < std::min(a.chunks, c0 + kSum16); ++c) {
          int64_t chunk = g * a.chunks + c;
          if (half == 0) _mm_prefetch(reinterpret_cast<const char*>(w + chunk * kBlock) + kPrefetch, _MM_HINT_T0);
          __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + chunk * kBlock));
          __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
          for (int m = 0; m < M; ++m) {
            const int8_t* q = a.q + m * a.in + 8 * chunk;
            const __m256i ql = _mm256_set1_epi32(four(q)), qh = _mm256_set1_epi32(four(q + 4));
            s16[m] = _mm256_add_epi16(s16[m],
                                      _mm256_add_epi16(_mm256_maddubs_epi16(lo, ql), _mm256_maddubs_epi16(hi, qh)));
          }
        }
        for (int m = 0; m < M; ++m) isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(s16[m], ones));
      }
      __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.s + g * kRows + 8 * half)));
      for (int m = 0; m < M; ++m) {
        __m256 f = _mm256_mul_ps(scale, _mm256_set1_ps(a.d[m * a.groups + g]));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), f, acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) _mm256_storeu_ps(a.y + m * a.ldy + 8 * half, acc[m]);
  }
}

template <int M>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma"))) void block_vnni(const Args& a) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const uint8_t* w = a.w;
  for (int64_t g = 0; g < a.groups; ++g) {
    // Two sums per row, low and high nibbles: two dependency chains of vpdpbusd instead of one.
    __m512i lo_sum[M], hi_sum[M];
    for (int m = 0; m < M; ++m) {
      lo_sum[m] = _mm512_set1_epi32(-8 * a.sum[m * a.groups + g]);
      hi_sum[m] = _mm512_setzero_si512();
    }
    for (int64_t c = 0; c < a.chunks; ++c, w += kBlock) {
      int64_t chunk = g * a.chunks + c;
      _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch, _MM_HINT_T0);
      __m512i v = _mm512_loadu_si512(w);
      __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      for (int m = 0; m < M; ++m) {
        const int8_t* q = a.q + m * a.in + 8 * chunk;
        lo_sum[m] = _mm512_dpbusd_epi32(lo_sum[m], lo, _mm512_set1_epi32(four(q)));
        hi_sum[m] = _mm512_dpbusd_epi32(hi_sum[m], hi, _mm512_set1_epi32(four(q + 4)));
      }
    }
    __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.s + g * kRows)));
    for (int m = 0; m < M; ++m) {
      __m512 f = _mm512_mul_ps(scale, _mm512_set1_ps(a.d[m * a.groups + g]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo_sum[m], hi_sum[m])), f, acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(a.y + m * a.ldy, acc[m]);
}

using BlockFn = void (*)(const Args&);

#define MG_Q4_TABLE(fn) {fn<1>, fn<2>, fn<3>, fn<4>}

enum Isa { kScalar = 0, kAvx2 = 1, kVnni = 2 };
const char* const kIsaNames[] = {"scalar", "avx2", "avx512_vnni"};

// The best path this CPU runs, capped by $ATEN_CPU_CAPABILITY (PyTorch's switch: avx2 or default, as ATen and
// Inductor's code follow it) and by $MINIGPT_Q4_ISA; read once.
Isa chosen_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    Isa best = kScalar;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      best = kAvx2;
    if (best == kAvx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
      best = kVnni;
    const char* aten = std::getenv("ATEN_CPU_CAPABILITY");
    if (aten != nullptr && (std::string(aten) == "avx2" || std::string(aten) == "AVX2")) best = std::min(best, kAvx2);
    if (aten != nullptr && (std::string(aten) == "default" || std::string(aten) == "DEFAULT")) best = kScalar;
    const char* cap = std::getenv("MINIGPT_Q4_ISA");
    if (cap != nullptr) {
      for (int i = 0; i < 3; ++i)
        if (std::string(cap) == kIsaNames[i]) best = std::min(best, static_cast<Isa>(i));
    }
    return best;
  }();
  return isa;
}

at::Tensor q4_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "minigpt::q4_mm: x must be float32 [rows, in]");
  TORCH_CHECK(weight.dim() == 3 && weight.scalar_type() == at::kByte && weight.size(2) == kBlock,
              "minigpt::q4_mm: weight must be uint8 [out / 16, in / 8, 64]");
  TORCH_CHECK(scale.dim() == 3 && scale.scalar_type() == at::kHalf && scale.size(0) == weight.size(0) &&
                  scale.size(2) == kRows,
              "minigpt::q4_mm: scale must be float16 [out / 16, groups, 16], as many blocks as the weight");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && scale.device().is_cpu(),
              "minigpt::q4_mm: CPU tensors only");
  const int64_t rows = x.size(0), in = x.size(1), blocks = weight.size(0), groups = scale.size(1);
  TORCH_CHECK(weight.size(1) * 8 == in, "minigpt::q4_mm: x has ", in, " inputs, the weight ", weight.size(1) * 8);
  TORCH_CHECK(groups > 0 && in % groups == 0 && (in / groups) % 8 == 0,
              "minigpt::q4_mm: ", groups, " groups do not divide ", in, " inputs into multiples of 8");
  at::Tensor xc = x.contiguous(), wc = weight.contiguous(), sc = scale.contiguous();
  at::Tensor y = at::empty({rows, blocks * kRows}, x.options());
  if (rows == 0 || blocks == 0) return y;
  Quantized qx;
  quantize(xc.data_ptr<float>(), rows, in, in / groups, chosen_isa() != kScalar, qx);
  static const BlockFn scalar[] = MG_Q4_TABLE(block_scalar), avx2[] = MG_Q4_TABLE(block_avx2),
                       vnni[] = MG_Q4_TABLE(block_vnni);
  const BlockFn* table = chosen_isa() == kVnni ? vnni : chosen_isa() == kAvx2 ? avx2 : scalar;
  const uint8_t* w = wc.data_ptr<uint8_t>();
  const c10::Half* s = sc.data_ptr<c10::Half>();
  float* out = y.data_ptr<float>();
  const int64_t chunks = in / groups / 8;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxRows) {
        int n = static_cast<int>(std::min<int64_t>(kMaxRows, rows - m0));
        Args a{w + b * (in / 8) * kBlock, s + b * groups * kRows, qx.q.data() + m0 * in, qx.d.data() + m0 * groups,
               qx.sum.data() + m0 * groups, in, groups, chunks, out + m0 * blocks * kRows + b * kRows,
               blocks * kRows};
        table[n - 1](a);
      }
    }
  });
  return y;
}

// minigpt::q4_dequant(packed, scale, bf16): the float matrix an int4 weight stands for, for prefill's GEMM.
//   packed [out, in / 2] uint8 (Q4_0's bytes, minigpt/model/quant.py): byte j of group g holds input g G + j in its
//          low nibble and g G + G / 2 + j in its high nibble (G = in / groups);
//   scale  [out, groups] float16;
//   result [out, in] float32, or bfloat16 when `bf16` (rounded to nearest even, as torch's conversion):
//          (level - 8) * scale, the product in float32 -- the numbers of dequantize_weight_int4, bit for bit.
// Why: PyTorch's element-wise version (unpack, subtract, scale: five passes over the matrix) took 1.47 ms for a
// SmolLM-135M layer's four matrices on 2 cores (AVX2 capped, Xeon model 167; this kernel 0.43 ms), a quarter of
// that layer's 128-row prefill.
// One value stored as float32, or as bfloat16 rounded to nearest even (torch's conversion).
inline void store1(float* out, float v) { *out = v; }
inline void store1(c10::BFloat16* out, float v) { *out = c10::BFloat16(v); }

template <typename T>
inline void dequant_group_scalar(const uint8_t* b, float s, int64_t half, T* lo, T* hi) {
  for (int64_t j = 0; j < half; ++j) {
    store1(lo + j, static_cast<float>((b[j] & 15) - 8) * s);
    store1(hi + j, static_cast<float>((b[j] >> 4) - 8) * s);
  }
}

// Eight bytes -> eight floats of each half (half a multiple of 8).
__attribute__((target("avx2,fma"))) inline void nibbles8(const uint8_t* b, __m256 s, __m256& lo, __m256& hi) {
  __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  const __m256i eight = _mm256_set1_epi32(8);
  lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v, _mm256_set1_epi32(15)), eight)), s);
  hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(v, 4), eight)), s);
}

// Eight values stored as float32, or as bfloat16 rounded to nearest even (finite inputs: levels times a float16
// scale), as store1 does one.
__attribute__((target("avx2,fma"))) inline void store8(float* out, __m256 f) { _mm256_storeu_ps(out, f); }

__attribute__((target("avx2,fma"))) inline void store8(c10::BFloat16* out, __m256 f) {
  __m256i u = _mm256_castps_si256(f);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  // lanes' low halves together
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

template <typename T>
__attribute__((target("avx2,fma"))) void dequant_group_avx2(const uint8_t* b, float s, int64_t half, T* lo, T* hi) {
  __m256 vs = _mm256_set1_ps(s), l, h;
  for (int64_t j = 0; j < half; j += 8) {
    nibbles8(b + j, vs, l, h);
    store8(lo + j, l);
    store8(hi + j, h);
  }
}

template <typename T>
void dequant_rows(const uint8_t* packed, const c10::Half* scale, int64_t out, int64_t in, int64_t groups, T* y) {
  const int64_t group = in / groups, half = group / 2;
  const bool vector = chosen_isa() != kScalar && half % 8 == 0;
  at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* b = packed + r * (in / 2) + g * half;
        float s = static_cast<float>(scale[r * groups + g]);
        T* lo = y + r * in + g * group;
        if (vector)
          dequant_group_avx2(b, s, half, lo, lo + half);
        else
          dequant_group_scalar(b, s, half, lo, lo + half);
      }
    }
  });
}

at::Tensor q4_dequant(const at::Tensor& packed, const at::Tensor& scale, bool bf16) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte,
              "minigpt::q4_dequant: packed must be uint8 [out, in / 2]");
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kHalf && scale.size(0) == packed.size(0),
              "minigpt::q4_dequant: scale must be float16 [out, groups], as many rows as packed");
  TORCH_CHECK(packed.device().is_cpu() && scale.device().is_cpu(), "minigpt::q4_dequant: CPU tensors only");
  const int64_t out = packed.size(0), in = 2 * packed.size(1), groups = scale.size(1);
  TORCH_CHECK(groups > 0 && in % groups == 0 && (in / groups) % 2 == 0,
              "minigpt::q4_dequant: ", groups, " groups do not divide ", in, " inputs into even sizes");
  at::Tensor pc = packed.contiguous(), sc = scale.contiguous();
  at::Tensor y = at::empty({out, in}, packed.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  if (out == 0) return y;
  if (bf16)
    dequant_rows(pc.data_ptr<uint8_t>(), sc.data_ptr<c10::Half>(), out, in, groups, y.data_ptr<c10::BFloat16>());
  else
    dequant_rows(pc.data_ptr<uint8_t>(), sc.data_ptr<c10::Half>(), out, in, groups, y.data_ptr<float>());
  return y;
}

std::string q4_isa() { return kIsaNames[chosen_isa()]; }

minigpt_ops::Registration registration;

void register_q4_op() {
  minigpt_ops::register_once(registration, "minigpt::q4_mm", [](torch::Library& def, bool define,
                                                                torch::Library& impl) {
    if (define) {
      def.def("q4_mm(Tensor x, Tensor weight, Tensor scale) -> Tensor");
      def.def("q4_dequant(Tensor packed, Tensor scale, bool bf16) -> Tensor");
    }
    def.def("q4_isa() -> str", TORCH_FN(q4_isa));
    impl.impl("q4_mm", TORCH_FN(q4_mm));
    impl.impl("q4_dequant", TORCH_FN(q4_dequant));
  });
}

}  // namespace

extern "C" {

// The C++ kernel of minigpt::q4_mm for this process (a Python process, or the runner before it loads a package that
// calls the op). Returns 0, or -1 with the reason in `err`.
int mg_q4_install(char* err, int errlen) { return minigpt_ops::report(register_q4_op, err, errlen); }

}  // extern "C"
