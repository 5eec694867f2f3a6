// Registering a CPU kernel of the runner library for one of MiniGPT's ops, once per process, and reporting a
// failure through a C interface, shared by q4_kernel.cpp, woq8_kernel.cpp and float_kernel.cpp; and the float
// kernels' choice of instruction set (part of the runner library's digest, minigpt/infer/launcher.py).
#pragma once

#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>

namespace minigpt_ops {

// The float kernels' instruction sets (woq8_kernel.cpp, float_kernel.cpp), best last.
enum FloatIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
inline const char* const kFloatIsaNames[] = {"scalar", "avx2", "avx512"};

// The best of them this CPU runs (AVX2 + FMA; AVX-512 F + BW + VL, for masked 8- and 16-bit loads), capped by
// $ATEN_CPU_CAPABILITY (avx2 / default) like PyTorch's own kernels and by the variable `cap_env` (avx2 | scalar:
// tests of the other paths). Each kernel reads it once.
inline FloatIsa float_isa(const char* cap_env) {
  __builtin_cpu_init();
  FloatIsa best = kScalar;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = kAvx2;
  if (best == kAvx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    best = kAvx512;
  const char* aten = std::getenv("ATEN_CPU_CAPABILITY");
  if (aten != nullptr && (std::string(aten) == "avx2" || std::string(aten) == "AVX2")) best = std::min(best, kAvx2);
  if (aten != nullptr && (std::string(aten) == "default" || std::string(aten) == "DEFAULT")) best = kScalar;
  const char* cap = std::getenv(cap_env);
  if (cap != nullptr)
    for (int i = 0; i < 3; ++i)
      if (std::string(cap) == kFloatIsaNames[i]) best = std::min(best, static_cast<FloatIsa>(i));
  return best;
}

struct Registration {
  std::mutex mutex;
  std::unique_ptr<torch::Library> definition, implementation;  // kept: dropping them unregisters the op
};

// Make `fill` register the CPU kernel of `op` ("minigpt::name"): fill(definition, define, implementation), `define`
// telling whether the op's schema must be defined too (a Python process that imported MiniGPT's fast path has
// defined it, with its shape function for tracing and its reference kernel). Refused where the op has a CPU kernel
// already; nothing happens the second time.
template <typename Fill>
void register_once(Registration& reg, const char* op, Fill&& fill) {
  std::lock_guard<std::mutex> guard(reg.mutex);
  if (reg.implementation) return;
  auto schema = c10::Dispatcher::singleton().findSchema({op, ""});
  if (schema.has_value() && schema->hasKernelForDispatchKey(c10::DispatchKey::CPU))
    throw std::runtime_error(std::string(op) + " already has another CPU kernel in this process");
  auto definition = std::make_unique<torch::Library>(torch::Library::FRAGMENT, "minigpt", std::nullopt, __FILE__,
                                                     __LINE__);
  auto implementation = std::make_unique<torch::Library>(torch::Library::IMPL, "minigpt", c10::DispatchKey::CPU,
                                                         __FILE__, __LINE__);
  fill(*definition, !schema.has_value(), *implementation);
  reg.definition = std::move(definition);
  reg.implementation = std::move(implementation);
}

// Run `install` for a C caller: 0, or -1 with the exception's message in `err` (errlen bytes, NUL-terminated).
template <typename Install>
int report(Install&& install, char* err, int errlen) {
  try {
    install();
    return 0;
  } catch (const std::exception& e) {
    if (err != nullptr && errlen > 0) {
      std::strncpy(err, e.what(), static_cast<size_t>(errlen) - 1);
      err[errlen - 1] = '\0';
    }
    return -1;
  }
}

}  // namespace minigpt_ops
