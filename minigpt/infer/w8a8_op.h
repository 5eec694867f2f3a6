// The op minigpt::w8a8_mm's table of int8 matrices, shared by its kernel (w8a8_op.cpp) and the native runner
// (native_runner.cpp), which fills it when it opens a bundle (pack_w8a8).
#pragma once

#include <ATen/ATen.h>
#include <ATen/native/quantized/PackedParams.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace minigpt_w8a8_op {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

// The int8 matrices the op may multiply, by the address of the matrix the package passes to it: their row scales
// (float32) for MiniGPT's own kernel (w8a8_kernel.cpp), FBGEMM's packed copies where it is used (one per block of
// rows: a large matrix, the LM head, is packed in blocks on several threads; see pack_w8a8), and the shape, checked
// at every call (an address reused by another matrix must not find a stale entry).
struct PackedMatrix {
  std::vector<Packed> blocks;  // empty where every call takes MiniGPT's kernel (the runner on a VNNI CPU)
  at::Tensor scale;
  int64_t rows = 0, cols = 0;
};
extern std::mutex packed_mutex;
extern std::unordered_map<const void*, PackedMatrix> packed_weights;

// Define minigpt::w8a8_mm unless this process has, and give it the C++ kernel (w8a8_op.cpp); once per process.
void register_w8a8_op();

}  // namespace minigpt_w8a8_op
