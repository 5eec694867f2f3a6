// MiniGPT's causal prefill attention for CPUs with AVX2 and without AVX-512: the CPU kernel of the op
// minigpt::causal_attention(q, keys, values, scale, start_pos) (minigpt/infer/fastpath/prefill_attention.py, which
// holds the reference and says where it is used). Built into the native runner library beside native_runner.cpp,
// registered in a Python process by mg_attention_install.
//
// What it computes, for every row b of the batch, query head h and new position i (absolute position
// p = start_pos + i), with j = h / rep the key/value head of h's group (GQA):
//   out[b, i, h] = sum_{c <= p} softmax_c(scale * q[b, i, h] . keys[b, j, c]) * values[b, j, c]
// (Vaswani et al. 2017, eq. 1, with the causal mask), float32 throughout.
//   q       [batch, seq, n_heads, head_dim], any strides with the last dimension contiguous (the projection's view);
//   keys, values [batch, n_kv_heads, kv_len, head_dim], last dimension contiguous, kv_len >= start_pos + seq
//           (the cache; columns past the last position are not read);
//   returns [batch, seq, n_heads, head_dim] float32, contiguous.
//
// How (AVX2 + FMA, head_dim a multiple of 16, at most 256): FlashAttention's online softmax (Dao et al. 2022,
// "FlashAttention", algorithm 1): a task is kBlockQ positions of one key/value head's group, its rep heads side by
// side (kBlockQ * rep query rows sharing every key and value read); the keys come in blocks of kBlockK, each block's
// scores S = Q K^T go to a small buffer (6 x 16 register tiles over the keys transposed once per call), the row
// maxima and sums are updated, the partial outputs rescaled, and O += P V (6 x 16 register tiles over the values as
// the cache holds them). Blocks past a task's last position are never computed; inside the diagonal block the
// masked scores are -inf and weigh exactly 0. The exponential is 2^x on scores pre-scaled by log2(e): 2^n times a
// degree-7 Taylor polynomial of 2^f on |f| <= 1/2 (relative error ~1e-7), exactly 0 below 2^-126. Tasks are taken
// largest first from a shared counter, so the causal triangle's uneven work spreads over the threads.
// Elsewhere (other head sizes, $MINIGPT_ATTENTION_ISA=scalar, CPUs without AVX2): one query row at a time, the
// scores, their softmax and the weighted sum in plain loops.
//
// Why: on a 2-core AVX2-only Zen 3 EPYC (family 25 model 1), SmolLM-135M's layer (9 query and 3 key/value heads of
// 64) at 512 tokens took 4.8-5.2 ms in SDPA's flash kernel for CPU, whose block products are oneMKL sgemm calls on
// 64 x 512 blocks of one head at a time, and 2.6 ms here (fastpath/prefill_attention.py, flash_wanted, gives the
// times at other lengths; docs/benchmarks.md, session 68).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "runner_ops.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace {

using minigpt_ops::kAvx2;

constexpr int kBlockQ = 16;   // new positions a task
constexpr int kBlockK = 64;   // keys a block
constexpr int kTileRows = 6;  // query rows a register tile (6 x 16 floats: 12 accumulators of AVX2's 16 registers)
constexpr int64_t kMaxDim = 256;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// This CPU's path, capped by $ATEN_CPU_CAPABILITY and $MINIGPT_ATTENTION_ISA (minigpt_ops::float_isa); AVX-512
// CPUs would run the AVX2 code, but the fast path does not call the op there (not measured). Read once.
minigpt_ops::FloatIsa chosen_isa() {
  static const minigpt_ops::FloatIsa isa = std::min(minigpt_ops::float_isa("MINIGPT_ATTENTION_ISA"), kAvx2);
  return isa;
}

// 2^x lane by lane for x <= 0 (scores minus their running maximum): 2^round(x) * p(x - round(x)), p the Taylor
// polynomial of 2^f = e^(f ln 2) to degree 7 (coefficients (ln 2)^k / k!); exactly 0 below -126, and for -inf.
__attribute__((target("avx2,fma"))) inline __m256 exp2_ps(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-126.0f);
  const __m256 under = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.5252734e-5f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530e-4f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_andnot_ps(under, _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), exponent)));
}

__attribute__((target("avx2,fma"))) inline float max_lanes(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

__attribute__((target("avx2,fma"))) inline float sum_lanes(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// The register tiles below name their accumulators one by one: held in an array, GCC 12 stored them to the stack
// after every multiply-add of a loop whose trip count is known at run time only (2.3x slower, session 68).
#define MG_ROWS6(X) X(0) X(1) X(2) X(3) X(4) X(5)

// S[r, 0:16] = sum_d Q[r, d] kt[d, 0:16] for 6 query rows (Q rows of `dim`, kt rows of kBlockK, S rows of kBlockK).
__attribute__((target("avx2,fma"))) inline void score_tile6(const float* q, int64_t dim, const float* kt, float* s) {
#define MG_ZERO(r) __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps();
  MG_ROWS6(MG_ZERO)
#undef MG_ZERO
  for (int64_t d = 0; d < dim; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * kBlockK), k1 = _mm256_loadu_ps(kt + d * kBlockK + 8);
#define MG_FMA(r)                                           \
  {                                                         \
    const __m256 qv = _mm256_broadcast_ss(q + r * dim + d); \
    a##r##0 = _mm256_fmadd_ps(qv, k0, a##r##0);             \
    a##r##1 = _mm256_fmadd_ps(qv, k1, a##r##1);             \
  }
    MG_ROWS6(MG_FMA)
#undef MG_FMA
  }
#define MG_STORE(r)                           \
  _mm256_storeu_ps(s + r * kBlockK, a##r##0); \
  _mm256_storeu_ps(s + r * kBlockK + 8, a##r##1);
  MG_ROWS6(MG_STORE)
#undef MG_STORE
}

// The same for one query row.
__attribute__((target("avx2,fma"))) inline void score_tile1(const float* q, const float* kt, int64_t dim, float* s) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m256 qv = _mm256_broadcast_ss(q + d);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt + d * kBlockK), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kt + d * kBlockK + 8), a1);
  }
  _mm256_storeu_ps(s, a0);
  _mm256_storeu_ps(s + 8, a1);
}

// O[r, 0:16] += sum_c P[r, c] v[c, 0:16] over the block's n_keys keys, 6 query rows (P rows of kBlockK, v rows of
// `ldv`, O rows of `dim`).
__attribute__((target("avx2,fma"))) inline void value_tile6(const float* p, const float* v, int64_t ldv, int n_keys,
                                                            float* o, int64_t dim) {
#define MG_LOAD(r) __m256 a##r##0 = _mm256_loadu_ps(o + r * dim), a##r##1 = _mm256_loadu_ps(o + r * dim + 8);
  MG_ROWS6(MG_LOAD)
#undef MG_LOAD
  for (int c = 0; c < n_keys; ++c) {
    const __m256 v0 = _mm256_loadu_ps(v + c * ldv), v1 = _mm256_loadu_ps(v + c * ldv + 8);
#define MG_FMA(r)                                               \
  {                                                             \
    const __m256 pv = _mm256_broadcast_ss(p + r * kBlockK + c); \
    a##r##0 = _mm256_fmadd_ps(pv, v0, a##r##0);                 \
    a##r##1 = _mm256_fmadd_ps(pv, v1, a##r##1);                 \
  }
    MG_ROWS6(MG_FMA)
#undef MG_FMA
  }
#define MG_STORE(r)                       \
  _mm256_storeu_ps(o + r * dim, a##r##0); \
  _mm256_storeu_ps(o + r * dim + 8, a##r##1);
  MG_ROWS6(MG_STORE)
#undef MG_STORE
}

// The same for one query row.
__attribute__((target("avx2,fma"))) inline void value_tile1(const float* p, const float* v, int64_t ldv, int n_keys,
                                                            float* o) {
  __m256 a0 = _mm256_loadu_ps(o), a1 = _mm256_loadu_ps(o + 8);
  for (int c = 0; c < n_keys; ++c) {
    const __m256 pv = _mm256_broadcast_ss(p + c);
    a0 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + c * ldv), a0);
    a1 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + c * ldv + 8), a1);
  }
  _mm256_storeu_ps(o, a0);
  _mm256_storeu_ps(o + 8, a1);
}

struct Shape {
  int64_t batch, seq, n_heads, n_kv, dim, rep, start;
  const float *q, *k, *v;
  int64_t q_sb, q_si, q_sh;  // strides of q (batch, position, head)
  int64_t k_sb, k_sh, k_si;  // of keys (batch, head, position)
  int64_t v_sb, v_sh, v_si;
  float scale;
  float* out;  // [batch, seq, n_heads, dim]
};

// Per thread: the task's query rows (scaled), partial outputs, scores, running maxima and sums.
struct Scratch {
  std::vector<float> q, o, s, m, l;
  explicit Scratch(int64_t rows, int64_t dim)
      : q(rows * dim), o(rows * dim), s(rows * kBlockK), m(rows), l(rows) {}
};

// One task: key/value head j of batch row b, new positions i0 .. i1 - 1; `kt` that head's keys transposed block by
// block, [blocks, dim, kBlockK] (columns past the last key zero).
__attribute__((target("avx2,fma"))) void flash_task(const Shape& t, int64_t b, int64_t j, int64_t i0, int64_t i1,
                                                    const float* kt, Scratch& w) {
  const int64_t dim = t.dim, rep = t.rep;
  const int rows = static_cast<int>((i1 - i0) * rep);
  const __m256 qscale = _mm256_set1_ps(t.scale * kLog2e);
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t g = 0; g < rep; ++g) {
      const float* src = t.q + b * t.q_sb + i * t.q_si + (j * rep + g) * t.q_sh;
      float* dst = w.q.data() + ((i - i0) * rep + g) * dim;
      for (int64_t d = 0; d < dim; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), qscale));
    }
  std::fill(w.o.begin(), w.o.begin() + rows * dim, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows, kNegInf);
  std::fill(w.l.begin(), w.l.begin() + rows, 0.0f);
  const int64_t n_keys = t.start + i1;  // keys 0 .. start + i1 - 1: the task's last position sees them all
  const float* values = t.v + b * t.v_sb + j * t.v_sh;
  float *q = w.q.data(), *o = w.o.data(), *s = w.s.data();
  for (int64_t c0 = 0; c0 < n_keys; c0 += kBlockK) {
    const int nk = static_cast<int>(std::min<int64_t>(kBlockK, n_keys - c0));
    const int nk16 = (nk + 15) / 16 * 16;
    int r = 0;
    for (; r + kTileRows <= rows; r += kTileRows)
      for (int c = 0; c < nk16; c += 16) score_tile6(q + r * dim, dim, kt + c0 * dim + c, s + r * kBlockK + c);
    for (; r < rows; ++r)
      for (int c = 0; c < nk16; c += 16) score_tile1(q + r * dim, kt + c0 * dim + c, dim, s + r * kBlockK + c);
    for (r = 0; r < rows; ++r) {
      float* sr = s + r * kBlockK;
      const int64_t visible = t.start + i0 + r / rep - c0 + 1;  // keys of this block at or before the row's position
      for (int c = static_cast<int>(std::clamp<int64_t>(visible, 0, nk16)); c < nk16; ++c) sr[c] = kNegInf;
      __m256 top = _mm256_set1_ps(kNegInf);
      for (int c = 0; c < nk16; c += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(sr + c));
      const float m_new = std::max(w.m[r], max_lanes(top));
      if (m_new == kNegInf) {  // no finite score yet (key 0 is always visible: only for -inf inputs)
        std::fill(sr, sr + nk16, 0.0f);
        continue;
      }
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int c = 0; c < nk16; c += 8) {
        const __m256 e = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(sr + c), mv));
        _mm256_storeu_ps(sr + c, e);
        sum = _mm256_add_ps(sum, e);
      }
      const float correction = w.m[r] == kNegInf ? 0.0f : std::exp2(w.m[r] - m_new);
      w.l[r] = w.l[r] * correction + sum_lanes(sum);
      w.m[r] = m_new;
      if (correction != 1.0f) {
        const __m256 cv = _mm256_set1_ps(correction);
        for (int64_t d = 0; d < dim; d += 8)
          _mm256_storeu_ps(o + r * dim + d, _mm256_mul_ps(_mm256_loadu_ps(o + r * dim + d), cv));
      }
    }
    const float* vb = values + c0 * t.v_si;
    for (r = 0; r + kTileRows <= rows; r += kTileRows)
      for (int64_t d = 0; d < dim; d += 16) value_tile6(s + r * kBlockK, vb + d, t.v_si, nk, o + r * dim + d, dim);
    for (; r < rows; ++r)
      for (int64_t d = 0; d < dim; d += 16) value_tile1(s + r * kBlockK, vb + d, t.v_si, nk, o + r * dim + d);
  }
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t g = 0; g < rep; ++g) {
      const int64_t r = (i - i0) * rep + g;
      const __m256 inv = _mm256_set1_ps(1.0f / w.l[r]);
      float* dst = t.out + ((b * t.seq + i) * t.n_heads + j * rep + g) * dim;
      for (int64_t d = 0; d < dim; d += 8)
        _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(o + r * dim + d), inv));
    }
}

void flash(const Shape& t) {
  // Every key/value head's keys transposed a block at a time, [batch, n_kv, key blocks, dim, kBlockK], zero past the
  // last key (read by the last tile). By blocks, not as one [dim, keys] matrix: rows 2 or 4 KB apart (512 or 1,024
  // keys) fell into the same few sets of the L1 cache (1,024 tokens: 11.6 against 8.7 ms a layer, session 68).
  const int64_t n_keys = t.start + t.seq, ldk = (n_keys + kBlockK - 1) / kBlockK * kBlockK;
  std::vector<float> kt(static_cast<size_t>(t.batch * t.n_kv * t.dim * ldk), 0.0f);
  at::parallel_for(0, t.batch * t.n_kv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bj = begin; bj < end; ++bj) {
      const float* k = t.k + (bj / t.n_kv) * t.k_sb + (bj % t.n_kv) * t.k_sh;
      float* dst = kt.data() + bj * t.dim * ldk;
      for (int64_t c = 0; c < n_keys; ++c)
        for (int64_t d = 0; d < t.dim; ++d) dst[(c / kBlockK * t.dim + d) * kBlockK + c % kBlockK] = k[c * t.k_si + d];
    }
  });
  const int64_t blocks = (t.seq + kBlockQ - 1) / kBlockQ, tasks = t.batch * t.n_kv * blocks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch w(kBlockQ * t.rep, t.dim);
    for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
      const int64_t block = blocks - 1 - task / (t.batch * t.n_kv), bj = task % (t.batch * t.n_kv);  // largest first
      flash_task(t, bj / t.n_kv, bj % t.n_kv, block * kBlockQ, std::min(t.seq, (block + 1) * kBlockQ),
                 kt.data() + bj * t.dim * ldk, w);
    }
  });
}

void rows_scalar(const Shape& t) {
  at::parallel_for(0, t.batch * t.seq * t.n_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(static_cast<size_t>(t.start + t.seq));
    for (int64_t row = begin; row < end; ++row) {
      const int64_t h = row % t.n_heads, i = (row / t.n_heads) % t.seq, b = row / (t.n_heads * t.seq);
      const float* q = t.q + b * t.q_sb + i * t.q_si + h * t.q_sh;
      const float* k = t.k + b * t.k_sb + (h / t.rep) * t.k_sh;
      const float* v = t.v + b * t.v_sb + (h / t.rep) * t.v_sh;
      const int64_t n = t.start + i + 1;
      float top = kNegInf, total = 0.0f;
      for (int64_t c = 0; c < n; ++c) {
        float dot = 0.0f;
        for (int64_t d = 0; d < t.dim; ++d) dot = std::fma(q[d], k[c * t.k_si + d], dot);
        p[c] = dot * t.scale;
        top = std::max(top, p[c]);
      }
      for (int64_t c = 0; c < n; ++c) total += (p[c] = std::exp(p[c] - top));
      float* o = t.out + row * t.dim;
      for (int64_t d = 0; d < t.dim; ++d) {
        float acc = 0.0f;
        for (int64_t c = 0; c < n; ++c) acc = std::fma(p[c], v[c * t.v_si + d], acc);
        o[d] = acc / total;
      }
    }
  });
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, double scale,
                            int64_t start_pos) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4,
              "minigpt::causal_attention: q [batch, seq, n_heads, head_dim], keys/values [batch, n_kv_heads, kv_len, "
              "head_dim]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "minigpt::causal_attention: float32 tensors only");
  TORCH_CHECK(q.device().is_cpu() && keys.device().is_cpu() && values.device().is_cpu(),
              "minigpt::causal_attention: CPU tensors only");
  const int64_t batch = q.size(0), seq = q.size(1), n_heads = q.size(2), dim = q.size(3), n_kv = keys.size(1);
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(0) == batch && keys.size(3) == dim && n_kv > 0 &&
                  n_heads % n_kv == 0,
              "minigpt::causal_attention: keys and values must be [", batch, ", n_kv_heads dividing ", n_heads,
              ", kv_len, ", dim, "]");
  TORCH_CHECK(start_pos >= 0 && keys.size(2) >= start_pos + seq, "minigpt::causal_attention: kv_len ", keys.size(2),
              " is shorter than start_pos + seq = ", start_pos + seq);
  at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  at::Tensor kc = keys.stride(3) == 1 ? keys : keys.contiguous();
  at::Tensor vc = values.stride(3) == 1 ? values : values.contiguous();
  at::Tensor out = at::empty({batch, seq, n_heads, dim}, qc.options());
  if (out.numel() == 0) return out;
  const Shape t{batch, seq, n_heads, n_kv, dim, n_heads / n_kv, start_pos,
                qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                qc.stride(0), qc.stride(1), qc.stride(2), kc.stride(0), kc.stride(1), kc.stride(2),
                vc.stride(0), vc.stride(1), vc.stride(2), static_cast<float>(scale), out.data_ptr<float>()};
  if (chosen_isa() == kAvx2 && dim % 16 == 0 && dim <= kMaxDim)
    flash(t);
  else
    rows_scalar(t);
  return out;
}

std::string attention_isa() { return minigpt_ops::kFloatIsaNames[chosen_isa()]; }

minigpt_ops::Registration registration;

void register_attention_op() {
  minigpt_ops::register_once(registration, "minigpt::causal_attention", [](torch::Library& def, bool define,
                                                                           torch::Library& impl) {
    if (define) def.def("causal_attention(Tensor q, Tensor keys, Tensor values, float scale, int start_pos) -> Tensor");
    def.def("attention_isa() -> str", TORCH_FN(attention_isa));
    impl.impl("causal_attention", TORCH_FN(causal_attention));
  });
}

}  // namespace

extern "C" {

// The C++ kernel of minigpt::causal_attention for this Python process. Returns 0, or -1 with the reason in `err`.
int mg_attention_install(char* err, int errlen) { return minigpt_ops::report(register_attention_op, err, errlen); }

}  // extern "C"
