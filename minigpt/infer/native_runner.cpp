// The native runner of MiniGPT's compiled decode step: a saved AOTInductor package (minigpt/infer/fastpath/aoti.py)
// and the tensors it reads (a bundle written by minigpt/infer/native.py), run through libtorch with no Python
// interpreter between tokens and, above all, without `import torch` in the process that calls it: the torch-free
// launcher (minigpt/cli/quick.py) loads this library with ctypes. Greedy decoding only. The same library gives a
// Python process the C++ kernels of the int8 and int4 product ops its compiled steps call (minigpt::w8a8_mm,
// w8a8_op.cpp, with MiniGPT's own kernel in w8a8_kernel.cpp; minigpt::q4_mm, q4_kernel.cpp; minigpt::woq8_mm, the
// head screen's, woq8_kernel.cpp; minigpt::float_mv, float32 and bfloat16 weights, float_kernel.cpp;
// minigpt::causal_attention, attention_kernel.cpp; all compiled into one library).
//
// The C interface (every function catches every C++ exception and reports it through `err`):
//   mg_open(package, prefill, bundle_dir, threads, err, errlen) -> handle or NULL (prefill: "" for none)
//   mg_generate(handle, prompt, n_prompt, max_new, cache_len, prefill_min, prefill_max, stop_ids, n_stop, on_token,
//               prefilled, err, errlen)
//       -> the number of tokens generated, or -1; on_token(token) is called for each, a non-zero return stops;
//       *prefilled: how many prompt tokens went through the prefill package (the rest through the step).
//   mg_close(handle)
//   mg_w8a8_install(err, errlen) -> 0 or -1: in a Python process, the C++ kernel of the int8 product op
//   mg_q4_install(err, errlen) -> 0 or -1: likewise for the int4 product op (q4_kernel.cpp)
//   mg_woq8_install(err, errlen) -> 0 or -1: likewise for the head screen's product op (woq8_kernel.cpp)
//   mg_float_install(err, errlen) -> 0 or -1: likewise for the float matrix-vector product op (float_kernel.cpp)
//
// The bundle: `tensors.bin` (every tensor's bytes, 64-byte aligned, memory-mapped read-only: no copy),
// `tensors.txt` (a header line `minigpt-native 1 n_layers n_kv_heads head_dim`, then one line per tensor:
// `name dtype offset ndim size... stride...`, sizes and strides in elements, the offset in bytes) and, when the step
// multiplies int8 matrices through FBGEMM (the `minigpt::w8a8_mm` op, minigpt/infer/fastpath/library.py),
// `w8a8.txt`: one `weight_name scale_name` pair per such matrix, multiplied in place by MiniGPT's own kernel
// (w8a8_kernel.cpp) on a CPU with AVX512-VNNI or AVX2, else packed for FBGEMM when the bundle is opened.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/library.h>

#include "w8a8_op.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
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

namespace minigpt_w8a8 {  // w8a8_kernel.cpp
bool available();
}  // namespace minigpt_w8a8

namespace {

using minigpt_w8a8_op::Packed;
using minigpt_w8a8_op::PackedMatrix;
using minigpt_w8a8_op::packed_mutex;
using minigpt_w8a8_op::packed_weights;
using minigpt_w8a8_op::register_w8a8_op;

constexpr int64_t kSplitRows = 8192;  // matrices with at least this many rows are packed in blocks

// Swallows c10 warnings: creating quantized tensors warns that they are deprecated, on every call.
struct QuietWarnings : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

constexpr long kGrowColumns = 64;  // the cache grows by at least this (launcher.CACHE_BUCKET, its lengths)

struct Runner {
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> prefill;  // the prompt's package, or none
  std::unordered_map<std::string, at::Tensor> constants;
  void* map = nullptr;
  size_t map_len = 0;
  int64_t n_layers = 0, n_kv_heads = 0, head_dim = 0;
  std::vector<const void*> packed;  // this runner's entries of packed_weights

  ~Runner() {
    loader.reset();  // the library's references to the tensors first, then the mapping under them
    prefill.reset();
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

// Enter the matrices w8a8.txt names for the op. The runner's steps multiply one row at a time, which MiniGPT's
// kernel does from the mapped matrix itself where it runs (VNNI or AVX2): nothing to pack. Elsewhere they are packed
// for FBGEMM on `threads` threads; FBGEMM packs a matrix on one core at ~0.1-0.2 GB/s (measured: SmolLM-135M's 28 MB
// int8 LM head 0.31-0.34 s), so matrices of kSplitRows rows or more are packed in one block of rows per thread.
void pack_w8a8(Runner& r, const std::string& dir, int threads) {
  std::ifstream list(dir + "/w8a8.txt");
  if (!list) return;
  int n = std::max(1, threads > 0 ? threads : at::get_num_threads());
  struct Item {
    const void* key;
    size_t block;
    int64_t rows;  // of the whole matrix
    at::Tensor weight, scale;
    std::string scale_name;
  };
  std::vector<Item> todo;
  std::unordered_map<const void*, size_t> n_blocks;
  std::string weight, scale;
  while (list >> weight >> scale) {
    auto w = r.constants.find(weight), s = r.constants.find(scale);
    if (w == r.constants.end() || s == r.constants.end() || w->second.scalar_type() != at::kChar ||
        w->second.dim() != 2 || s->second.dim() != 1 || s->second.size(0) != w->second.size(0))
      throw std::runtime_error("w8a8.txt: " + weight + " / " + scale + " is not an int8 matrix and its row scales");
    const at::Tensor& wt = w->second;
    if (minigpt_w8a8::available()) {
      register_w8a8_op();
      std::lock_guard<std::mutex> lock(packed_mutex);
      packed_weights[wt.data_ptr()] = PackedMatrix{{}, s->second.to(at::kFloat).contiguous(), wt.size(0), wt.size(1)};
      r.packed.push_back(wt.data_ptr());
      continue;
    }
    int64_t rows = wt.size(0), blocks = rows >= kSplitRows ? n : 1, step = (rows + blocks - 1) / blocks;
    size_t made = 0;
    for (int64_t start = 0; start < rows; start += step, ++made) {
      int64_t len = std::min(step, rows - start);
      todo.push_back({wt.data_ptr(), made, rows, wt.narrow(0, start, len), s->second.narrow(0, start, len), scale});
    }
    n_blocks[wt.data_ptr()] = made;
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
  // Largest first, so that the head's blocks do not end up behind a queue of small matrices.
  std::vector<size_t> order(todo.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return todo[a].weight.numel() > todo[b].weight.numel();
  });
  std::atomic<size_t> next{0};
  auto work = [&]() {
    QuietWarnings quiet;
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);  // per thread: the handler is thread-local
    for (size_t k = next++; k < order.size(); k = next++) {
      size_t i = order[k];
      try {
        const auto& w = todo[i].weight;
        auto q = at::_make_per_channel_quantized_tensor(w, todo[i].scale.to(at::kDouble),
                                                       at::zeros({w.size(0)}, at::kLong), 0);
        done[i] = prepack.call(q, std::nullopt);
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < std::min<int>(n, static_cast<int>(todo.size())); ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  at::globalContext().setQEngine(engine);
  std::lock_guard<std::mutex> lock(packed_mutex);
  for (size_t i = 0; i < todo.size(); ++i) {
    if (!errors[i].empty()) throw std::runtime_error("packing an int8 matrix for FBGEMM failed: " + errors[i]);
    auto& matrix = packed_weights[todo[i].key];
    if (matrix.blocks.empty()) {
      matrix.blocks.resize(n_blocks[todo[i].key]);
      matrix.scale = r.constants.at(todo[i].scale_name).to(at::kFloat).contiguous();
      matrix.rows = todo[i].rows;
      matrix.cols = todo[i].weight.size(1);
      r.packed.push_back(todo[i].key);
    }
    matrix.blocks[todo[i].block] = done[i];
  }
}

// The greedy step's head screen could not certify its token (minigpt/infer/fastpath/screen.py): the argmax of
// the full float32 logits of the hidden state `h` [1, 1, dim] it returned.
int64_t screen_fallback(const Runner& r, const at::Tensor& h) {
  auto it = r.constants.find("head_weight");
  if (it == r.constants.end()) throw std::runtime_error("the bundle has no head_weight for the screen's fallback");
  return at::mv(it->second.to(at::kFloat), h.reshape({-1}).to(at::kFloat)).argmax().item<int64_t>();
}

// A package loaded with the bundle's tensors as its constants, read in place (user_managed: no copy).
std::unique_ptr<torch::inductor::AOTIModelPackageLoader> load_package(const Runner& r, const char* package) {
  auto loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(package, "model", false, 1, -1);
  std::unordered_map<std::string, at::Tensor> wanted;
  for (const auto& name : loader->get_constant_fqns()) {
    auto it = r.constants.find(name);
    if (it == r.constants.end()) throw std::runtime_error("the bundle has no tensor " + name);
    wanted[name] = it->second;
  }
  loader->load_constants(wanted, false, true, true);
  return loader;
}

}  // namespace

extern "C" {

int mg_q4_install(char* err, int errlen);    // q4_kernel.cpp: minigpt::q4_mm's kernel
int mg_woq8_install(char* err, int errlen);  // woq8_kernel.cpp: minigpt::woq8_mm's kernel
int mg_float_install(char* err, int errlen);  // float_kernel.cpp: minigpt::float_mv's kernel

void* mg_open(const char* package, const char* prefill, const char* bundle_dir, int threads, char* err, int errlen) {
  auto r = std::make_unique<Runner>();
  try {
    if (threads > 0) at::set_num_threads(threads);
    load_bundle(*r, bundle_dir);
    pack_w8a8(*r, bundle_dir, threads);  // before the package: its loader looks the op up
    char q4_err[512] = {0};
    if (mg_q4_install(q4_err, sizeof q4_err) != 0) throw std::runtime_error(q4_err);  // the int4 op, likewise
    if (mg_woq8_install(q4_err, sizeof q4_err) != 0) throw std::runtime_error(q4_err);  // the head screen's op
    if (mg_float_install(q4_err, sizeof q4_err) != 0) throw std::runtime_error(q4_err);  // float products
    r->loader = load_package(*r, package);
    if (prefill != nullptr && prefill[0] != '\0') r->prefill = load_package(*r, prefill);
    return r.release();
  } catch (const std::exception& e) {
    set_error(e.what(), err, errlen);
    return nullptr;
  }
}

long mg_generate(void* handle, const int64_t* prompt, long n_prompt, long max_new, long cache_len, long prefill_min,
                 long prefill_max, const int64_t* stop_ids, long n_stop, int (*on_token)(int64_t), long* prefilled,
                 char* err, int errlen) {
  try {
    auto* r = static_cast<Runner*>(handle);
    if (n_prompt < 1 || max_new < 1 || n_prompt + max_new > cache_len + 1)
      throw std::runtime_error("prompt and new tokens do not fit in the cache");
    if (r->prefill && (prefill_min < 1 || prefill_max < prefill_min))
      throw std::runtime_error("the prefill package's rows must be 1 <= prefill_min <= prefill_max");
    c10::InferenceMode guard;
    auto f32 = at::TensorOptions().dtype(at::kFloat);
    // The step attends to every column it is given (masked): the cache starts at one bucket and grows as the
    // positions fill it, as generate.grown_cache_for does in Python (135M int4: 1.06x over 128 tokens).
    std::vector<at::Tensor> k, v;
    long length = std::min(cache_len, kGrowColumns);
    for (int64_t i = 0; i < r->n_layers; ++i) {
      k.push_back(at::zeros({1, r->n_kv_heads, length, r->head_dim}, f32));
      v.push_back(at::zeros({1, r->n_kv_heads, length, r->head_dim}, f32));
    }
    // At least `needed` columns (kv_cache.fitted_length(needed)), the first `held` carried over.
    auto fit = [&](long needed, long held) {
      if (needed <= length) return;
      long power = 1;
      while (power * 2 <= needed) power *= 2;
      long step = std::max(kGrowColumns, power / 4);
      length = std::min(cache_len, (needed - 1 + step) / step * step);
      for (auto* layers : {&k, &v})
        for (auto& t : *layers) {
          at::Tensor longer = at::zeros({1, r->n_kv_heads, length, r->head_dim}, f32);
          longer.narrow(2, 0, held).copy_(t.narrow(2, 0, held));
          t = longer;
        }
    };
    auto i64 = at::TensorOptions().dtype(at::kLong);
    at::Tensor token = at::zeros({1, 1}, i64), pos = at::zeros({1}, i64), pad = at::zeros({1}, i64);
    auto run = [&](torch::inductor::AOTIModelPackageLoader& package, const at::Tensor& tokens) {
      std::vector<at::Tensor> inputs{tokens, pos, pad};
      inputs.insert(inputs.end(), k.begin(), k.end());
      inputs.insert(inputs.end(), v.begin(), v.end());
      // The package writes its columns of every cache itself (aoti.StepModule): its outputs are the logits, a
      // greedy step's token and final hidden state, or the prefill package's columns.
      return package.boxed_run(std::move(inputs));
    };
    long p = 0;  // the next position: column p holds position p
    // The prompt but its last token through the prefill package, at most prefill_max tokens a call, each call
    // padded to prefill_min rows (the package's least) where the cache has the room: a padding row only writes
    // columns past the tokens given, which the next call or step overwrites before any query reads them.
    while (r->prefill && p < n_prompt - 1) {
      long rows = std::min(prefill_max, n_prompt - 1 - p), padded = std::max(rows, prefill_min);
      if (p + padded > cache_len) break;  // the rest a token at a time
      fit(p + padded, p);
      at::Tensor chunk = at::zeros({1, padded}, i64);
      std::memcpy(chunk.data_ptr<int64_t>(), prompt + p, static_cast<size_t>(rows) * sizeof(int64_t));
      pos.fill_(p);
      run(*r->prefill, chunk);
      p += rows;
    }
    if (prefilled != nullptr) *prefilled = p;
    int64_t next = prompt[p];
    long produced = 0;
    // The rest of the prompt (its last token, or all of it without a prefill package) a token at a time through
    // the one-token step, then the new tokens.
    for (; p < n_prompt + max_new - 1; ++p) {
      fit(p + 1, p);
      token.fill_(p < n_prompt ? prompt[p] : next);
      pos.fill_(p);
      std::vector<at::Tensor> out = run(*r->loader, token);
      if (p < n_prompt - 1) continue;
      next = out[0].scalar_type() == at::kLong ? out[0].reshape({-1})[0].item<int64_t>()  // a greedy step's token
                                               : out[0].reshape({-1}).argmax().item<int64_t>();
      if (next < 0) next = screen_fallback(*r, out.back());
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
