// The C++ kernel of the op minigpt::w8a8_mm(x, weight) in the runner library: int8 activations x the int8 matrices
// of the table in w8a8_op.h, through MiniGPT's own kernel (w8a8_kernel.cpp) or FBGEMM's packed copies, registered in
// a Python process by mg_w8a8_install and in the runner's process when it opens a bundle (native_runner.cpp).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "runner_ops.h"
#include "w8a8_op.h"

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>

namespace minigpt_w8a8 {  // w8a8_kernel.cpp
bool available();
const char* isa_name();
void quantize(const float* x, int64_t rows, int64_t in, int64_t padded, int8_t* q, int32_t* sum, uint8_t* low);
void product(const int8_t* q, const int32_t* qsum, const uint8_t* low, int64_t rows, int64_t padded, const int8_t* w,
             int64_t in, const float* scale, int64_t n0, int64_t n1, float* y, int64_t ldy);
}  // namespace minigpt_w8a8

namespace minigpt_w8a8_op {

std::mutex packed_mutex;
std::unordered_map<const void*, PackedMatrix> packed_weights;

namespace {

std::mutex op_mutex;
std::unique_ptr<torch::Library> op_definition, op_implementation;

constexpr int64_t kOwnRows = 4;  // calls of up to this many rows take MiniGPT's kernel (decode steps)
constexpr int64_t kQuantizeGrain = 16;  // activation rows per thread's share of the quantizer, at least

// MiniGPT's kernel (w8a8_kernel.cpp): the same numbers as FBGEMM's, read from the matrix in place.
at::Tensor own_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == weight.size(1),
              "minigpt::w8a8_mm: x must be float32 [rows, ", weight.size(1), "]");
  at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t rows = xc.size(0), in = xc.size(1), out = wc.size(0), padded = (in + 63) / 64 * 64;
  at::Tensor y = at::empty({rows, out}, xc.options());
  if (rows == 0 || out == 0) return y;
  std::vector<int8_t> q(static_cast<size_t>(rows * padded));
  std::vector<int32_t> qsum(static_cast<size_t>(rows));
  std::vector<uint8_t> low(static_cast<size_t>(rows));
  const float* xp = xc.data_ptr<float>();
  // A prompt's rows on every thread; a decode step's few rows (fewer than the grain) inline, no parallel region.
  at::parallel_for(0, rows, kQuantizeGrain, [&](int64_t begin, int64_t end) {
    minigpt_w8a8::quantize(xp + begin * in, end - begin, in, padded, q.data() + begin * padded, qsum.data() + begin,
                           low.data() + begin);
  });
  const int8_t* w = wc.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (out + 15) / 16, 1, [&](int64_t begin, int64_t end) {  // in units of 16 rows
    minigpt_w8a8::product(q.data(), qsum.data(), low.data(), rows, padded, w, in, s, begin * 16,
                          std::min(out, end * 16), yp, out);
  });
  return y;
}

// minigpt::w8a8_mm(x, weight): the rows of x (already divided by their scale) times the int8 matrix, as the Python
// implementation in minigpt/infer/fastpath/library.py computes it: up to kOwnRows rows through MiniGPT's kernel
// where the CPU has VNNI, more through FBGEMM's packed copy where there is one (it blocks the rows), the same bits.
at::Tensor w8a8_mm(const at::Tensor& x, const at::Tensor& weight) {
  std::vector<Packed> blocks;
  at::Tensor scale;
  {
    std::lock_guard<std::mutex> lock(packed_mutex);
    auto it = packed_weights.find(weight.data_ptr());
    TORCH_CHECK(it != packed_weights.end(), "minigpt::w8a8_mm: this int8 matrix has no packed copy");
    TORCH_CHECK(weight.dim() == 2 && it->second.rows == weight.size(0) && it->second.cols == weight.size(1),
                "minigpt::w8a8_mm: the packed copy at this address is of another matrix");
    blocks = it->second.blocks;
    scale = it->second.scale;
  }
  if (minigpt_w8a8::available() && (blocks.empty() || x.size(0) <= kOwnRows))
    return own_mm(x, weight, scale);
  TORCH_CHECK(!blocks.empty(), "minigpt::w8a8_mm: this int8 matrix has no packed copy for FBGEMM");
  if (blocks.size() == 1) return blocks[0]->apply_with_input_q_dq_qweight_dq_output_fp32(x, 1.0, 128);
  // Every output is its own row's dot product: blocks of rows give the whole product's numbers.
  std::vector<at::Tensor> parts;
  for (const auto& b : blocks) parts.push_back(b->apply_with_input_q_dq_qweight_dq_output_fp32(x, 1.0, 128));
  return at::cat(parts, -1);
}

// minigpt::w8a8_adopt(address, rows, cols, packed) / w8a8_forget(address): a Python process hands over the copies
// it packed itself (minigpt/infer/fastpath/library.py, which also needs them for its eager products) and withdraws
// one when its matrix is freed.
void w8a8_adopt(int64_t address, int64_t rows, int64_t cols, const Packed& packed, const at::Tensor& scale) {
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == rows, "minigpt::w8a8_adopt: scale must be [", rows, "]");
  std::lock_guard<std::mutex> lock(packed_mutex);
  packed_weights[reinterpret_cast<const void*>(address)] =
      PackedMatrix{{packed}, scale.to(at::kFloat).contiguous(), rows, cols};
}

// minigpt::w8a8_register(address, rows, cols, scale): a matrix that MiniGPT's kernel multiplies in place for every
// row count, with no packed copy (a Python process on a CPU without VNNI, where FBGEMM's product saturates).
void w8a8_register(int64_t address, int64_t rows, int64_t cols, const at::Tensor& scale) {
  TORCH_CHECK(minigpt_w8a8::available(), "minigpt::w8a8_register: MiniGPT's int8 kernel does not run on this CPU");
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == rows, "minigpt::w8a8_register: scale must be [", rows, "]");
  std::lock_guard<std::mutex> lock(packed_mutex);
  packed_weights[reinterpret_cast<const void*>(address)] =
      PackedMatrix{{}, scale.to(at::kFloat).contiguous(), rows, cols};
}

void w8a8_forget(int64_t address) {
  std::lock_guard<std::mutex> lock(packed_mutex);
  packed_weights.erase(reinterpret_cast<const void*>(address));
}

// minigpt::w8a8_isa(): which kernel takes calls of up to kOwnRows rows (and every call on a matrix without a packed
// copy): MiniGPT's, "avx512_vnni" or "avx2", else "fbgemm".
std::string w8a8_isa() { return minigpt_w8a8::isa_name(); }

}  // namespace

// Define the op unless this process has (a Python process that imported MiniGPT's fast path defines it, with its
// shape function for tracing) and give it this C++ kernel; refused where the op has a CPU kernel already (the
// Python one, which would not know this library's packed copies). Every call through the op from an AOTInductor
// package goes through this kernel then: with the Python one each of a step's ~120 int8 products called back into
// the interpreter (int8 decode 58-65 against 88-98 tokens/s at 135M, docs/benchmarks.md).
void register_w8a8_op() {
  std::lock_guard<std::mutex> guard(op_mutex);
  if (op_implementation) return;
  auto& dispatcher = c10::Dispatcher::singleton();
  auto op = dispatcher.findSchema({"minigpt::w8a8_mm", ""});
  if (op.has_value() && op->hasKernelForDispatchKey(c10::DispatchKey::CPU))
    throw std::runtime_error("minigpt::w8a8_mm already has another CPU kernel in this process (MiniGPT's Python "
                             "one); run the native runner in a process that has not used it");
  auto definition = std::make_unique<torch::Library>(torch::Library::FRAGMENT, "minigpt", std::nullopt, __FILE__,
                                                     __LINE__);
  if (!op.has_value()) definition->def("w8a8_mm(Tensor x, Tensor weight) -> Tensor");
  definition->def("w8a8_adopt(int address, int rows, int cols, "
                  "__torch__.torch.classes.quantized.LinearPackedParamsBase packed, Tensor scale) -> ()",
                  TORCH_FN(w8a8_adopt));
  definition->def("w8a8_register(int address, int rows, int cols, Tensor scale) -> ()", TORCH_FN(w8a8_register));
  definition->def("w8a8_forget(int address) -> ()", TORCH_FN(w8a8_forget));
  definition->def("w8a8_isa() -> str", TORCH_FN(w8a8_isa));
  auto implementation = std::make_unique<torch::Library>(torch::Library::IMPL, "minigpt", c10::DispatchKey::CPU,
                                                         __FILE__, __LINE__);
  implementation->impl("w8a8_mm", TORCH_FN(w8a8_mm));
  op_definition = std::move(definition);
  op_implementation = std::move(implementation);
}


}  // namespace minigpt_w8a8_op

extern "C" {

// In a Python process: make this library's kernel the CPU kernel of minigpt::w8a8_mm (see register_w8a8_op).
// Returns 0, or -1 with the reason in `err`.
int mg_w8a8_install(char* err, int errlen) {
  return minigpt_ops::report(minigpt_w8a8_op::register_w8a8_op, err, errlen);
}

}  // extern "C"
