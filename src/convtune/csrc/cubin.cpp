// convtune's Triton kernels launched from C++: the launches of one run, recorded in Python
// (convtune/kernels/recording.py: each compiled kernel's binary, shared memory, warps, grid and run-time
// arguments), repeated on every call with the operands' addresses. The arguments are passed as Triton's own
// launcher passes them: each run-time argument in order (a tensor's address, an i32, an i64, an f32's bits),
// then Triton's two scratch pointers, null (a recording refuses kernels that take scratch memory). The few
// driver functions used are looked up in libcuda.so.1 when first needed (dlopen, as Triton's own launcher does),
// so the build links no libcuda and needs only the toolkit's cuda.h. Compiled in the CUDA build
// (CONVTUNE_WITH_CUDNN: the build that finds cuDNN's headers is the one with CUDA's); elsewhere make_cubin raises.
#include "executable.h"

#if defined(CONVTUNE_WITH_CUDNN) && __has_include(<cuda.h>)
#define CONVTUNE_WITH_CUBIN
#endif

#ifdef CONVTUNE_WITH_CUBIN

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <unordered_map>

namespace convtune {

namespace {

// The driver functions this file calls, from libcuda.so.1 (the driver's library, on every machine with a CUDA
// driver), looked up once.
struct Driver {
  decltype(&::cuGetErrorString) get_error_string = nullptr;
  decltype(&::cuCtxGetCurrent) ctx_get_current = nullptr;
  decltype(&::cuModuleLoadData) module_load_data = nullptr;
  decltype(&::cuModuleGetFunction) module_get_function = nullptr;
  decltype(&::cuFuncGetAttribute) func_get_attribute = nullptr;
  decltype(&::cuFuncSetAttribute) func_set_attribute = nullptr;
  decltype(&::cuLaunchKernel) launch_kernel = nullptr;
};

template <typename F>
void resolve(void* library, F& slot, const char* name) {
  slot = reinterpret_cast<F>(dlsym(library, name));
  TORCH_CHECK(slot, "convtune: the CUDA driver's library (libcuda.so.1) has no ", name,
              "; update the NVIDIA driver");
}

const Driver& driver_api() {
  static const Driver driver = [] {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(library, "convtune: the CUDA driver's library libcuda.so.1 could not be loaded (", dlerror(),
                "); install the NVIDIA driver");
    Driver d;
    resolve(library, d.get_error_string, "cuGetErrorString");
    resolve(library, d.ctx_get_current, "cuCtxGetCurrent");
    resolve(library, d.module_load_data, "cuModuleLoadData");
    resolve(library, d.module_get_function, "cuModuleGetFunction");
    resolve(library, d.func_get_attribute, "cuFuncGetAttribute");
    resolve(library, d.func_set_attribute, "cuFuncSetAttribute");
    resolve(library, d.launch_kernel, "cuLaunchKernel");
    return d;
  }();
  return driver;
}

void check_driver(CUresult result, const std::string& label, const char* what, const std::string& kernel) {
  if (result == CUDA_SUCCESS) return;
  const char* message = nullptr;
  driver_api().get_error_string(result, &message);
  TORCH_CHECK(false, label, ": the CUDA driver's ", what, " of Triton kernel ", kernel, " failed: ",
              message ? message : "unknown error");
}

// Makes ``device``'s primary context current in this thread where none is: the driver API needs one, and a
// thread whose first CUDA work is ours (autograd's backward threads) may have none yet, which the CUDA runtime
// would set up on its first call. cudaSetDevice makes the primary context current (CUDA 12 and later).
void ensure_context(c10::DeviceIndex device, const std::string& label) {
  CUcontext current = nullptr;
  if (driver_api().ctx_get_current(&current) == CUDA_SUCCESS && current) return;
  TORCH_CHECK(cudaSetDevice(device) == cudaSuccess, label, ": the CUDA runtime could not make device ",
              text(static_cast<int64_t>(device)), " current");
}

// A launch argument: where its value comes from.
struct Argument {
  enum class Kind { Tensor, I32, I64, F32 } kind = Kind::I32;
  int operand = 0;  // Tensor: 0 a, 1 b, 2 out, 3 + i the i-th buffer
  int64_t offset = 0;  // Tensor: bytes into it
  int32_t i32 = 0;
  int64_t i64 = 0;
  uint32_t f32 = 0;  // an f32's bits, as Triton packs it
};

struct Launch {
  std::string name, binary;
  unsigned shared = 0, threads = 128;
  unsigned grid[3] = {1, 1, 1};
  std::vector<Argument> arguments;
};

class Cubin final : public Executable {
 public:
  Cubin(Geometry g, int64_t device_index, std::vector<BufferSpec> buffers, std::vector<CubinLaunch> launches)
      : Executable(std::move(g)), buffers_(std::move(buffers)), workspace_bytes_(buffers_bytes(buffers_)) {
    for (auto& recorded : launches) {
      Launch launch;
      launch.name = std::move(recorded.name);
      launch.binary = std::move(recorded.binary);
      TORCH_CHECK_VALUE(recorded.shared >= 0 && recorded.warps > 0 && recorded.warps <= 32 && recorded.grid.size() == 3,
                        geometry.label, ": a recorded launch of ", launch.name, " has shared memory ",
                        text(recorded.shared), ", ", text(recorded.warps), " warps and a grid of ",
                        text(static_cast<int64_t>(recorded.grid.size())), " dimensions");
      launch.shared = static_cast<unsigned>(recorded.shared);
      launch.threads = static_cast<unsigned>(32 * recorded.warps);
      for (int i = 0; i < 3; ++i) {
        TORCH_CHECK_VALUE(recorded.grid[i] >= 0 && recorded.grid[i] < (int64_t{1} << 31), geometry.label,
                          ": a recorded launch of ", launch.name, " has a grid of ", text(recorded.grid));
        launch.grid[i] = static_cast<unsigned>(recorded.grid[i]);
      }
      for (const CubinParam& p : recorded.params) launch.arguments.push_back(argument(p, launch.name));
      launches_.push_back(std::move(launch));
    }
    // Loaded now on the device it is made for, so that a binary the driver refuses fails here (the runtime then
    // makes it again from its recipe, or the layer runs on the Python path), not on every call; kept for the
    // calls there, which then take no lock. The modules stay loaded for the process's life, as Triton's own
    // do (the registry keeps every executable; unloading at exit would race the driver's own teardown).
    home_device_ = static_cast<c10::DeviceIndex>(device_index);
    c10::cuda::CUDAGuard guard(home_device_);
    for (size_t i = 0; i < launches_.size(); ++i) home_.push_back(function(i, home_device_));
  }

  const char* kind() const override { return "cubin"; }
  int64_t workspace_bytes() const override { return workspace_bytes_; }

  at::Tensor run(const at::Tensor& a, const at::Tensor& b) const override {
    c10::cuda::CUDAGuard guard(a.device());
    ensure_context(a.device().index(), geometry.label);
    // Triton compiled the kernels for addresses aligned to 16 bytes (PyTorch's allocations are): an operand
    // that is a view at another address is copied first.
    at::Tensor x = aligned(a), y = aligned(b);
    at::Tensor out = empty_result(x);
    std::vector<char*> bases = {static_cast<char*>(x.data_ptr()), static_cast<char*>(y.data_ptr()),
                                static_cast<char*>(out.data_ptr())};
    at::Tensor workspace;
    if (!buffers_.empty()) {
      workspace = at::empty({std::max<int64_t>(workspace_bytes_, 1)}, x.options().dtype(at::kByte));
      auto views = carve(workspace, buffers_);
      for (const BufferSpec& buffer : buffers_) bases.push_back(static_cast<char*>(views.at(buffer.name).data_ptr()));
    }
    const auto& driver = driver_api();
    const c10::DeviceIndex device = x.device().index();
    CUstream stream = c10::cuda::getCurrentCUDAStream(device).stream();
    std::vector<uint64_t> values;
    std::vector<void*> pointers;
    for (size_t i = 0; i < launches_.size(); ++i) {
      const Launch& launch = launches_[i];
      values.assign(launch.arguments.size() + 2, 0);  // the two scratch pointers last, null
      pointers.resize(values.size());
      for (size_t j = 0; j < launch.arguments.size(); ++j) {
        const Argument& arg = launch.arguments[j];
        void* slot = &values[j];
        switch (arg.kind) {
          case Argument::Kind::Tensor: {
            auto address = reinterpret_cast<uint64_t>(bases.at(arg.operand) + arg.offset);
            std::memcpy(slot, &address, sizeof address);
            break;
          }
          case Argument::Kind::I32: std::memcpy(slot, &arg.i32, sizeof arg.i32); break;
          case Argument::Kind::I64: std::memcpy(slot, &arg.i64, sizeof arg.i64); break;
          case Argument::Kind::F32: std::memcpy(slot, &arg.f32, sizeof arg.f32); break;
        }
        pointers[j] = slot;
      }
      pointers[launch.arguments.size()] = &values[launch.arguments.size()];
      pointers[launch.arguments.size() + 1] = &values[launch.arguments.size() + 1];
      if (launch.grid[0] == 0 || launch.grid[1] == 0 || launch.grid[2] == 0) continue;  // nothing to compute
      CUfunction f = device == home_device_ ? home_[i] : function(i, device);
      check_driver(driver.launch_kernel(f, launch.grid[0], launch.grid[1],
                                         launch.grid[2], launch.threads, 1, 1, launch.shared, stream, pointers.data(),
                                         nullptr),
                   geometry.label, "launch", launch.name);
    }
    return out;
  }

 private:
  Argument argument(const CubinParam& p, const std::string& kernel) const {
    Argument arg;
    if (p.type == "tensor") {
      arg.kind = Argument::Kind::Tensor;
      static const char* const operands[3] = {"a", "b", "out"};
      arg.operand = -1;
      for (int i = 0; i < 3; ++i)
        if (p.operand == operands[i]) arg.operand = i;
      for (size_t i = 0; i < buffers_.size() && arg.operand < 0; ++i)
        if (p.operand == buffers_[i].name) arg.operand = static_cast<int>(3 + i);
      TORCH_CHECK_VALUE(arg.operand >= 0 && p.integer >= 0, geometry.label, ": a recorded argument of ", kernel,
                        " lies in '", p.operand, "', which is neither an operand nor a declared buffer");
      arg.offset = p.integer;
    } else if (p.type == "i32") {
      arg.kind = Argument::Kind::I32;
      arg.i32 = static_cast<int32_t>(p.integer);
    } else if (p.type == "i64") {
      arg.kind = Argument::Kind::I64;
      arg.i64 = p.integer;
    } else if (p.type == "f32") {
      arg.kind = Argument::Kind::F32;
      float value = static_cast<float>(p.real);
      std::memcpy(&arg.f32, &value, sizeof value);
    } else {
      TORCH_CHECK_VALUE(false, geometry.label, ": a recorded argument of ", kernel, " has the type '", p.type,
                        "' (tensor, i32, i64 and f32 are passed)");
    }
    return arg;
  }

  static at::Tensor aligned(const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone(at::MemoryFormat::Preserve);
  }

  // The i-th launch's kernel on ``device``, loaded from its binary on first use there.
  CUfunction function(size_t i, c10::DeviceIndex device) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& loaded = functions_[device];
    if (loaded.empty()) loaded.assign(launches_.size(), nullptr);
    if (loaded[i]) return loaded[i];
    const auto& driver = driver_api();
    const Launch& launch = launches_[i];
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    TORCH_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device).stream(), &capturing) == cudaSuccess &&
                    capturing == cudaStreamCaptureStatusNone,
                geometry.label, ": Triton kernel ", launch.name, " is first run on device ", text(int64_t{device}),
                " inside a CUDA graph capture, where the driver cannot load it; run the layer once there before "
                "capturing");
    ensure_context(device, geometry.label);
    CUmodule module = nullptr;
    check_driver(driver.module_load_data(&module, launch.binary.data()), geometry.label, "loading of the binary",
                 launch.name);
    CUfunction f = nullptr;
    check_driver(driver.module_get_function(&f, module, launch.name.c_str()), geometry.label, "lookup",
                 launch.name);
    if (launch.shared > 49152) {  // above the default: the kernel opts in, as Triton's loader does
      int optin = 0, fixed = 0;
      TORCH_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess,
                  geometry.label, ": the CUDA runtime's query of the device's shared memory failed");
      check_driver(driver.func_get_attribute(&fixed, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, f), geometry.label,
                   "query of the static shared memory", launch.name);
      check_driver(driver.func_set_attribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin - fixed),
                   geometry.label, "shared memory opt-in", launch.name);
    }
    loaded[i] = f;
    return f;
  }

  std::vector<BufferSpec> buffers_;
  int64_t workspace_bytes_;
  std::vector<Launch> launches_;
  c10::DeviceIndex home_device_ = 0;  // the device the executable is made for
  std::vector<CUfunction> home_;  // its kernels there (set in the constructor, read without a lock)
  mutable std::mutex mutex_;  // guards functions_
  mutable std::unordered_map<c10::DeviceIndex, std::vector<CUfunction>> functions_;  // every device's, loaded there
};

}  // namespace

bool with_cubin() { return true; }

ExecutablePtr make_cubin(Geometry g, int64_t device_index, std::vector<BufferSpec> buffers,
                         std::vector<CubinLaunch> launches) {
  TORCH_CHECK_VALUE(g.device_type == at::kCUDA, g.label, ": convtune's Triton kernels run from C++ on CUDA only");
  TORCH_CHECK_VALUE(!launches.empty(), g.label, ": a Triton executable needs at least one recorded launch");
  return std::make_shared<Cubin>(std::move(g), device_index, std::move(buffers), std::move(launches));
}

}  // namespace convtune

#else  // CONVTUNE_WITH_CUBIN

namespace convtune {

bool with_cubin() { return false; }

ExecutablePtr make_cubin(Geometry g, int64_t, std::vector<BufferSpec>, std::vector<CubinLaunch>) {
  TORCH_CHECK_VALUE(false, g.label, ": this build of convtune's extension has no CUDA launcher (it is built where "
                    "cuDNN's and CUDA's headers are found); install them and rebuild (convtune native --rebuild)");
}

}  // namespace convtune

#endif
