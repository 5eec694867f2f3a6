// The native runner of MiniGPT's compiled decode step: a saved AOTInductor package (minigpt/infer/fastpath/aoti.py)
// and the tensors it reads (a bundle written by minigpt/infer/fastpath/native.py), run through libtorch with no
// Python interpreter between tokens and, above all, without `import torch` in the process that calls it: the
// torch-free launcher (minigpt/cli/quick.py) loads this library with ctypes. Greedy decoding only.
//
// The C interface (every function catches every C++ exception and reports it through `err`):
//   mg_open(package, bundle_dir, threads, err, errlen) -> handle or NULL
//   mg_generate(handle, prompt, n_prompt, max_new, cache_len, stop_ids, n_stop, on_token, err, errlen)
//       -> the number of tokens generated, or -1; on_token(token) is called for each, a non-zero return stops.
//   mg_close(handle)
//
// The bundle: `tensors.bin` (every tensor's bytes, 64-byte aligned, memory-mapped read-only: no copy),
// `tensors.txt` (a header line `minigpt-native 1 n_layers n_kv_heads head_dim`, then one line per tensor:
// `name dtype offset ndim size... stride...`, sizes and strides in elements, the offset in bytes) and, when the step
// multiplies int8 matrices through FBGEMM (the `minigpt::w8a8_mm` op, minigpt/infer/fastpath/library.py),
// `w8a8.txt`: one `weight_name scale_name` pair per such matrix, packed for FBGEMM when the bundle is opened.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/library.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

// FBGEMM's packed copies of the int8 matrices, by the address of the matrix the package passes to the op.
std::mutex packed_mutex;
std::unordered_map<const void*, Packed> packed_weights;
std::unique_ptr<torch::Library> op_definition, op_implementation;

// minigpt::w8a8_mm(x, weight): the rows of x (already divided by their scale) times the int8 matrix, through its
// packed copy, as the Python implementation in minigpt/infer/fastpath/library.py computes it.
at::Tensor w8a8_mm(const at::Tensor& x, const at::Tensor& weight) {
  Packed packed;
  {
    std::lock_guard<std::mutex> lock(packed_mutex);
    auto it = packed_weights.find(weight.data_ptr());
    TORCH_CHECK(it != packed_weights.end(), "minigpt::w8a8_mm: this int8 matrix has no packed copy");
    packed = it->second;
  }
  return packed->apply_with_input_q_dq_qweight_dq_output_fp32(x, 1.0, 128);
}

// Define and implement the op unless this process has it already (a Python process that imported MiniGPT's
// fast path defines it; its implementation would not know this runner's packed copies, so there it is refused).
void register_w8a8_op() {
  auto& dispatcher = c10::Dispatcher::singleton();
  if (op_implementation) return;
  if (dispatcher.findSchema({"minigpt::w8a8_mm", ""}).has_value())
    throw std::runtime_error("minigpt::w8a8_mm is defined by this process already (run the native runner in a "
                             "process that has not imported MiniGPT's fast path)");
  op_definition = std::make_unique<torch::Library>(torch::Library::FRAGMENT, "minigpt", std::nullopt, __FILE__,
                                                   __LINE__);
  op_definition->def("w8a8_mm(Tensor x, Tensor weight) -> Tensor");
  op_implementation = std::make_unique<torch::Library>(torch::Library::IMPL, "minigpt", c10::DispatchKey::CPU,
                                                       __FILE__, __LINE__);
  op_implementation->impl("w8a8_mm", TORCH_FN(w8a8_mm));
}

struct Runner {
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
  std::unordered_map<std::string, at::Tensor> constants;
  void* map = nullptr;
  size_t map_len = 0;
  int64_t n_layers = 0, n_kv_heads = 0, head_dim = 0;
  std::vector<const void*> packed;  // this runner's entries of packed_weights

  ~Runner() {
    loader.reset();  // the library's references to the tensors first, then the mapping under them
    {
      std::lock_guard<std::mutex> lock(packed_mutex);
      for (const void* p : packed) packed_weights.erase(p);
    }
    constants.clear();
    if (map != nullptr) munmap(map, map_len);
  }
};

void set_error(const std::string& message, char* err, int errlen) {
  if (err != nullptr && errlen > 0) {
    std::strncpy(err, message.c_str(), static_cast<size_t>(errlen) - 1);
    err[errlen - 1] = '\0';
  }
}

at::ScalarType dtype_of(const std::string& name) {
  static const std::unordered_map<std::string, at::ScalarType> names = {
      {"float32", at::kFloat}, {"bfloat16", at::kBFloat16}, {"float16", at::kHalf}, {"int8", at::kChar},
      {"uint8", at::kByte}, {"int32", at::kInt}, {"int64", at::kLong}};
  auto it = names.find(name);
  if (it == names.end()) throw std::runtime_error("tensors.txt: unknown dtype " + name);
  return it->second;
}

// Map tensors.bin and describe every tensor of tensors.txt over it; the sizes are checked against the file.
void load_bundle(Runner& r, const std::string& dir) {
  std::ifstream index(dir + "/tensors.txt");
  if (!index) throw std::runtime_error("cannot read " + dir + "/tensors.txt");
  std::string magic;
  int version = 0;
  index >> magic >> version >> r.n_layers >> r.n_kv_heads >> r.head_dim;
  if (magic != "minigpt-native" || version != 1 || r.n_layers < 1)
    throw std::runtime_error(dir + "/tensors.txt is not a MiniGPT native bundle of version 1");
  std::string bin = dir + "/tensors.bin";
  int fd = open(bin.c_str(), O_RDONLY);
  if (fd < 0) throw std::runtime_error("cannot open " + bin);
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size <= 0) {
    close(fd);
    throw std::runtime_error("cannot stat " + bin);
  }
  r.map_len = static_cast<size_t>(st.st_size);
  r.map = mmap(nullptr, r.map_len, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (r.map == MAP_FAILED) {
    r.map = nullptr;
    throw std::runtime_error("cannot map " + bin);
  }
  std::string name, dtype;
  int64_t offset = 0, ndim = 0;
  while (index >> name >> dtype >> offset >> ndim) {
    if (ndim < 0 || ndim > 8) throw std::runtime_error("tensors.txt: bad rank for " + name);
    std::vector<int64_t> sizes(ndim), strides(ndim);
    for (auto& s : sizes) index >> s;
    for (auto& s : strides) index >> s;
    if (!index) throw std::runtime_error("tensors.txt: truncated line for " + name);
    at::ScalarType type = dtype_of(dtype);
    int64_t extent = 1;  // elements spanned: 1 + sum (size - 1) * stride, every step checked for overflow
    bool bad = false;
    for (int64_t i = 0; i < ndim; ++i) {
      int64_t span = 0;
      bad = bad || sizes[i] < 0 || strides[i] < 0 || __builtin_mul_overflow(sizes[i] > 0 ? sizes[i] - 1 : 0,
                                                                             strides[i], &span);
      if (sizes[i] == 0) extent = 0;
      bad = bad || (extent != 0 && __builtin_add_overflow(extent, span, &extent));
    }
    int64_t bytes = 0, last = 0;
    bad = bad || __builtin_mul_overflow(extent, static_cast<int64_t>(c10::elementSize(type)), &bytes) ||
          offset < 0 || __builtin_add_overflow(offset, bytes, &last);
    if (bad) throw std::runtime_error("tensors.txt: bad shape or offset for " + name);
    if (last > static_cast<int64_t>(r.map_len))
      throw std::runtime_error("tensors.txt: " + name + " lies outside tensors.bin");
    void* data = static_cast<char*>(r.map) + offset;
    r.constants[name] = at::from_blob(data, sizes, strides, at::TensorOptions().dtype(type));
  }
  if (!index.eof()) throw std::runtime_error("tensors.txt: unreadable line after " + name);
}

// Pack the matrices w8a8.txt names for FBGEMM, `threads` at a time (one matrix packs on one core).
void pack_w8a8(Runner& r, const std::string& dir, int threads) {
  std::ifstream list(dir + "/w8a8.txt");
  if (!list) return;
  std::vector<std::pair<at::Tensor, at::Tensor>> todo;
  std::string weight, scale;
  while (list >> weight >> scale) {
    auto w = r.constants.find(weight), s = r.constants.find(scale);
    if (w == r.constants.end() || s == r.constants.end() || w->second.scalar_type() != at::kChar ||
        w->second.dim() != 2 || s->second.dim() != 1 || s->second.size(0) != w->second.size(0))
      throw std::runtime_error("w8a8.txt: " + weight + " / " + scale + " is not an int8 matrix and its row scales");
    todo.emplace_back(w->second, s->second);
  }
  if (todo.empty()) return;
  register_w8a8_op();
  auto prepack = c10::Dispatcher::singleton()
                     .findSchemaOrThrow("quantized::linear_prepack", "")
                     .typed<Packed(at::Tensor, std::optional<at::Tensor>)>();
  auto engine = at::globalContext().qEngine();
  at::globalContext().setQEngine(at::QEngine::FBGEMM);  // the packed type decides the kernel at every call
  std::vector<Packed> done(todo.size());
  std::vector<std::string> errors(todo.size());
  auto work = [&](size_t first, size_t step) {
    for (size_t i = first; i < todo.size(); i += step) {
      try {
        const auto& [w, s] = todo[i];
        auto q = at::_make_per_channel_quantized_tensor(w, s.to(at::kDouble), at::zeros({w.size(0)}, at::kLong), 0);
        done[i] = prepack.call(q, std::nullopt);
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    }
  };
  size_t n = std::max(1, std::min(threads > 0 ? threads : at::get_num_threads(), static_cast<int>(todo.size())));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < n; ++t) pool.emplace_back(work, t, n);
  work(0, n);
  for (auto& t : pool) t.join();
  at::globalContext().setQEngine(engine);
  std::lock_guard<std::mutex> lock(packed_mutex);
  for (size_t i = 0; i < todo.size(); ++i) {
    if (!errors[i].empty()) throw std::runtime_error("packing an int8 matrix for FBGEMM failed: " + errors[i]);
    packed_weights[todo[i].first.data_ptr()] = done[i];
    r.packed.push_back(todo[i].first.data_ptr());
  }
}

}  // namespace

extern "C" {

void* mg_open(const char* package, const char* bundle_dir, int threads, char* err, int errlen) {
  auto r = std::make_unique<Runner>();
  try {
    if (threads > 0) at::set_num_threads(threads);
    load_bundle(*r, bundle_dir);
    pack_w8a8(*r, bundle_dir, threads);  // before the package: its loader looks the op up
    r->loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(package, "model", false, 1, -1);
    std::unordered_map<std::string, at::Tensor> wanted;
    for (const auto& name : r->loader->get_constant_fqns()) {
      auto it = r->constants.find(name);
      if (it == r->constants.end()) throw std::runtime_error("the bundle has no tensor " + name);
      wanted[name] = it->second;
    }
    // user_managed: the library reads the mapped tensors in place (no copy)
    r->loader->load_constants(wanted, false, true, true);
    return r.release();
  } catch (const std::exception& e) {
    set_error(e.what(), err, errlen);
    return nullptr;
  }
}

long mg_generate(void* handle, const int64_t* prompt, long n_prompt, long max_new, long cache_len,
                 const int64_t* stop_ids, long n_stop, int (*on_token)(int64_t), char* err, int errlen) {
  try {
    auto* r = static_cast<Runner*>(handle);
    if (n_prompt < 1 || max_new < 1 || n_prompt + max_new > cache_len + 1)
      throw std::runtime_error("prompt and new tokens do not fit in the cache");
    c10::InferenceMode guard;
    auto f32 = at::TensorOptions().dtype(at::kFloat);
    std::vector<at::Tensor> k, v;
    for (int64_t i = 0; i < r->n_layers; ++i) {
      k.push_back(at::zeros({1, r->n_kv_heads, cache_len, r->head_dim}, f32));
      v.push_back(at::zeros({1, r->n_kv_heads, cache_len, r->head_dim}, f32));
    }
    auto i64 = at::TensorOptions().dtype(at::kLong);
    at::Tensor token = at::zeros({1, 1}, i64), pos = at::zeros({1}, i64), pad = at::zeros({1}, i64);
    int64_t next = prompt[0];
    long produced = 0;
    // The prompt goes through the one-token step too, a token at a time: column p holds position p.
    for (long p = 0; p < n_prompt + max_new - 1; ++p) {
      token.fill_(p < n_prompt ? prompt[p] : next);
      pos.fill_(p);
      std::vector<at::Tensor> inputs{token, pos, pad};
      inputs.insert(inputs.end(), k.begin(), k.end());
      inputs.insert(inputs.end(), v.begin(), v.end());
      std::vector<at::Tensor> out = r->loader->boxed_run(std::move(inputs));
      for (int64_t i = 0; i < r->n_layers; ++i) {
        k[i].narrow(2, p, 1).copy_(out[1 + i]);
        v[i].narrow(2, p, 1).copy_(out[1 + r->n_layers + i]);
      }
      if (p < n_prompt - 1) continue;
      next = out[0].reshape({-1}).argmax().item<int64_t>();
      ++produced;
      bool stop = on_token != nullptr && on_token(next) != 0;
      for (long s = 0; s < n_stop && !stop; ++s) stop = stop_ids[s] == next;
      if (stop || produced == max_new) break;
    }
    return produced;
  } catch (const std::exception& e) {
    set_error(e.what(), err, errlen);
    return -1;
  }
}

void mg_close(void* handle) { delete static_cast<Runner*>(handle); }

}  // extern "C"
