// Executables: one (problem, algorithm) made runnable once, kept in a registry by an integer handle.
//
// The control plane (Python) describes a problem and the algorithm chosen for it, and adds an
// executable under a handle; the ops (ops.cpp) run executables by handle on every call. An
// executable knows its operands' shapes and strides, so the ops check every call against it and
// the meta kernels know the result without running anything.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace convtune {

enum class Direction : int64_t { Fwd = 0, BwdData = 1, BwdFilter = 2 };

// A tensor's shape and strides (dense in the problem's layout).
struct Spec {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
};

// One scratch tensor carved from the workspace, as the algorithm declares it (Algorithm.buffers).
struct BufferSpec {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype;
};

// What every executable knows of its problem.
struct Geometry {
  Direction direction = Direction::Fwd;
  at::ScalarType dtype = at::kFloat;
  at::DeviceType device_type = at::kCPU;
  bool channels_last = false;
  bool allow_tf32 = true;
  int64_t groups = 1;
  std::vector<int64_t> stride, padding, dilation;
  Spec a, b, out;  // the two operands and the result: fwd (x, w) -> y, bwd_data (dy, w) -> dx, bwd_filter (x, dy) -> dw
  std::string label;  // "convtune:<problem key> by <algorithm>": errors and profiler ranges name it
};

// Numbers in error messages, formatted without std::ostream: where the extension's inline stream code
// and the process's C++ runtime differ (the H200 machine's), streaming an integer crashes the process.
std::string text(int64_t value);
std::string text(at::IntArrayRef values);  // "[2, 64, 8, 8]"

// A convolution's bias added to its result ``y`` in place (broadcast over the channel dimension), where there is one;
// a bias torch's own convolution refuses (not 1-dimensional with y's channels, another dtype or device) is refused
// here too, with a ValueError that starts with ``layer()``: a broadcast would give a wrong result without a word.
template <typename Label>
void add_bias(at::Tensor& y, const std::optional<at::Tensor>& bias, const Label& layer) {
  if (!bias.has_value() || !bias->defined()) return;
  const at::Tensor& b = *bias;
  // sym_size: under torch.compile or export the sizes may be symbolic, and size() would make them constants
  const bool fits = b.dim() == 1 && b.sym_size(0) == y.sym_size(1);
  if (!fits || b.scalar_type() != y.scalar_type() || b.device() != y.device()) {
    const int64_t channels = y.sym_size(1).guard_int(__FILE__, __LINE__);
    TORCH_CHECK_VALUE(false, layer(), ": bias of shape ", text(b.sizes()), " and dtype ",
                      c10::toString(b.scalar_type()), " on ", b.device(), " for a result of ", text(channels),
                      " channels and dtype ", c10::toString(y.scalar_type()), " on ", y.device(),
                      ": give a 1-dimensional bias of ", text(channels),
                      " elements of the result's dtype and device, as torch's convolution requires");
  }
  std::vector<int64_t> shape(y.dim(), 1);
  shape[1] = b.size(0);  // a layer's parameter: its size is a constant
  y.add_(b.view(shape));
}

// The names of the operands of a direction, for error messages.
const char* operand_name(Direction d, int index);

class Executable {
 public:
  explicit Executable(Geometry g) : geometry(std::move(g)) {}
  virtual ~Executable() = default;
  Executable(const Executable&) = delete;
  Executable& operator=(const Executable&) = delete;

  // The result of the problem on operands (a, b) that passed check(); a new tensor dense in the layout.
  virtual at::Tensor run(const at::Tensor& a, const at::Tensor& b) const = 0;
  // Bytes of workspace one run takes from PyTorch's caching allocator.
  virtual int64_t workspace_bytes() const { return 0; }
  // What runs: "native", "gemm_1x1", "gemm_1x1_strided", "cudnn".
  virtual const char* kind() const = 0;
  // What rebuilds this executable in another process without searching again (a cuDNN plan's
  // serialized form); empty where the description alone is enough.
  virtual std::string serialized() const { return ""; }

  // Raises ValueError naming the operand and the mismatch unless (a, b) fit the problem: its dtype,
  // shapes, device type (unless ``device`` is false: meta kernels see meta tensors) and, where
  // ``strides``, dense in its layout (else laid_out makes them so).
  void check(const at::Tensor& a, const at::Tensor& b, bool device = true, bool strides = true) const;
  // A layer's input on the module's hot path: raises ValueError unless ``x`` has the problem's first operand's
  // shape and is dense in its layout (another is another signature, which the module tunes for itself).
  void check_input(const at::Tensor& x) const;
  // A new, uninitialised result tensor on ``like``'s device.
  at::Tensor empty_result(const at::Tensor& like) const;

  const Geometry geometry;
};

using ExecutablePtr = std::shared_ptr<const Executable>;

// The registry. ``description`` says everything the executable was made from: adding a handle
// again with the same description does nothing, with another one raises.
void add_executable(int64_t handle, const std::string& description, ExecutablePtr executable);
bool has_executable(int64_t handle);
// The executable of ``handle``; raises ValueError when none was added (stale or foreign handle).
ExecutablePtr find_executable(int64_t handle);
int64_t executable_count();
// Tests: every result an executable allocates starts as NaN, so an element left unwritten shows.
void set_poison(bool on);

// Whether ``t`` has ``spec``'s shape and, where a dimension is longer than 1, its strides.
bool fits(const at::Tensor& t, const Spec& spec);
// ``t`` itself when it fits ``spec``, else a copy laid out as ``spec`` says.
at::Tensor laid_out(const at::Tensor& t, const Spec& spec);
// dy as the two gradients' executables read it (``data``'s first operand, ``filter``'s second): laid out once
// where both want one layout and dy has their shape (a loss's sum() gives an expanded dy, which each would
// otherwise copy), else dy itself (each lays it out as it needs; a wrong shape: its error names it).
at::Tensor gradient_for_both(const at::Tensor& dy, int64_t data, int64_t filter);
// Dense strides of ``shape`` in channels_first (row-major) or channels_last (N, *spatial, C) order.
std::vector<int64_t> dense_strides(const std::vector<int64_t>& shape, bool channels_last);

// Views of a 1-D uint8 workspace for each buffer, in order, each start aligned to 256 bytes.
std::map<std::string, at::Tensor> carve(const at::Tensor& workspace, const std::vector<BufferSpec>& buffers);
int64_t buffers_bytes(const std::vector<BufferSpec>& buffers);

// The executables (native.cpp, gemm.cpp, cudnn.cpp).
ExecutablePtr make_native(Geometry g);
ExecutablePtr make_gemm_1x1(Geometry g, bool strided, std::vector<BufferSpec> buffers);

struct CudnnSpec {
  int64_t device_index = 0;
  Spec x, w, y;  // as cuDNN sees them (a 1-D problem lifted to 2-D)
  std::vector<int64_t> stride, padding, dilation;  // likewise
  std::string tag;  // the plan's name as the cuDNN frontend gives it: its engine and knob choices
};
bool with_cudnn();
bool with_cubin();  // whether this build launches Triton's kernels (cubin.cpp)
// ``serialized`` (from CudnnPlan::serialized, same cuDNN and GPU) rebuilds the plan without heuristics;
// empty: the plan is found among cuDNN's heuristics by its tag.
ExecutablePtr make_cudnn(Geometry g, CudnnSpec spec, const std::string& serialized);

// One argument of a recorded Triton launch (convtune/kernels/recording.py): a tensor (``operand``: 'a', 'b',
// 'out' or a buffer's name; ``integer``: the byte offset in it), or a number ('i32', 'i64', 'f32').
struct CubinParam {
  std::string type;
  std::string operand;
  int64_t integer = 0;
  double real = 0.0;
};
// One recorded launch: the compiled kernel (its name and binary), its shared memory, warps and grid, and the
// arguments the compiled kernel takes at run time, in order (Triton's two scratch pointers follow, null).
struct CubinLaunch {
  std::string name;
  std::string binary;
  int64_t shared = 0;
  int64_t warps = 4;
  std::vector<int64_t> grid;
  std::vector<CubinParam> params;
};
// convtune's Triton kernels launched from C++ (cubin.cpp; a CUDA build only, elsewhere it raises).
// (Loaded on ``device_index`` when made; another device loads them on its first run there.)
ExecutablePtr make_cubin(Geometry g, int64_t device_index, std::vector<BufferSpec> buffers,
                         std::vector<CubinLaunch> launches);

}  // namespace convtune
