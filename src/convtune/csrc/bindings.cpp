// convtune._C: the control plane's door to the executables (the ops themselves register in ops.cpp).
#include <torch/extension.h>

#include "executable.h"

namespace py = pybind11;

namespace convtune {
namespace {

at::ScalarType scalar_type(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "uint8") return at::kByte;
  TORCH_CHECK_VALUE(false, "convtune: dtype ", name, " is none of float32, float16, bfloat16, uint8");
}

Geometry geometry(int64_t direction, const std::string& dtype, const std::string& device, bool channels_last,
                  bool allow_tf32, int64_t groups, std::vector<int64_t> stride, std::vector<int64_t> padding,
                  std::vector<int64_t> dilation, std::vector<std::vector<int64_t>> shapes,
                  std::vector<std::vector<int64_t>> strides, std::string label) {
  TORCH_CHECK_VALUE(direction >= 0 && direction <= 2, "convtune: direction ", direction, " is not 0, 1 or 2");
  TORCH_CHECK_VALUE(device == "cpu" || device == "cuda", "convtune: device ", device, " is neither cpu nor cuda");
  TORCH_CHECK_VALUE(shapes.size() == 3 && strides.size() == 3, "convtune: three operand shapes and strides needed");
  Geometry g;
  g.direction = static_cast<Direction>(direction);
  g.dtype = scalar_type(dtype);
  g.device_type = device == "cuda" ? at::kCUDA : at::kCPU;
  g.channels_last = channels_last;
  g.allow_tf32 = allow_tf32;
  g.groups = groups;
  g.stride = std::move(stride);
  g.padding = std::move(padding);
  g.dilation = std::move(dilation);
  Spec* specs[3] = {&g.a, &g.b, &g.out};
  for (int i = 0; i < 3; ++i) *specs[i] = Spec{shapes[i], strides[i]};
  g.label = std::move(label);
  return g;
}

}  // namespace
}  // namespace convtune

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace convtune;
  m.doc() = "convtune's native runtime: executables by handle, run by torch.ops.convtune.tuned_conv/tuned_run";
  py::class_<Geometry>(m, "Geometry");
  m.def("geometry", &geometry, py::arg("direction"), py::arg("dtype"), py::arg("device"), py::arg("channels_last"),
        py::arg("allow_tf32"), py::arg("groups"), py::arg("stride"), py::arg("padding"), py::arg("dilation"),
        py::arg("shapes"), py::arg("strides"), py::arg("label"),
        "The description of one problem's direction: operand shapes and strides (a, b, result), conv parameters.");
  m.def(
      "add_native",
      [](int64_t handle, const std::string& description, const Geometry& g) {
        add_executable(handle, description, make_native(g));
      },
      "torch:native: PyTorch's own convolution (at::convolution, at::convolution_backward).");
  m.def(
      "add_gemm_1x1",
      [](int64_t handle, const std::string& description, const Geometry& g, bool strided,
         const std::vector<std::tuple<std::string, std::vector<int64_t>, std::string>>& buffers) {
        std::vector<BufferSpec> specs;
        for (const auto& [name, shape, dtype] : buffers) specs.push_back(BufferSpec{name, shape, scalar_type(dtype)});
        add_executable(handle, description, make_gemm_1x1(g, strided, std::move(specs)));
      },
      "gemm:1x1 (strided=False) or gemm:1x1_strided: matrix products of views, scratch as the buffers declare.");
  m.def(
      "add_cudnn",
      [](int64_t handle, const std::string& description, const Geometry& g, int64_t device_index,
         std::vector<std::vector<int64_t>> shapes, std::vector<std::vector<int64_t>> strides, std::vector<int64_t> stride,
         std::vector<int64_t> padding, std::vector<int64_t> dilation, std::string tag, py::bytes serialized) {
        if (has_executable(handle)) return add_executable(handle, description, nullptr);  // only checks the description
        TORCH_CHECK_VALUE(shapes.size() == 3 && strides.size() == 3, "convtune: x, w, y shapes and strides needed");
        CudnnSpec spec{device_index,      Spec{shapes[0], strides[0]}, Spec{shapes[1], strides[1]},
                       Spec{shapes[2], strides[2]}, std::move(stride), std::move(padding), std::move(dilation),
                       std::move(tag)};
        add_executable(handle, description, make_cudnn(g, std::move(spec), std::string(serialized)));
      },
      "A cuDNN execution plan: from its serialized form, else the one of cuDNN's heuristics with the tag (the frontend's plan name).");
  m.def("has", &has_executable, "Whether an executable has this handle.");
  m.def("count", &executable_count, "How many executables this process holds.");
  m.def(
      "workspace_bytes", [](int64_t handle) { return find_executable(handle)->workspace_bytes(); },
      "Bytes of workspace one run of the executable allocates.");
  m.def(
      "kind", [](int64_t handle) { return std::string(find_executable(handle)->kind()); },
      "What the executable runs: native, gemm_1x1, gemm_1x1_strided or cudnn.");
  m.def(
      "serialized", [](int64_t handle) { return py::bytes(find_executable(handle)->serialized()); },
      "What rebuilds the executable without searching (a cuDNN plan's serialized form; empty for the others).");
  m.def(
      "tuned_conv",
      [](const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t fwd, int64_t bwd_data,
         int64_t bwd_filter) {
        static auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("convtune::tuned_conv", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                               int64_t, int64_t, int64_t)>();
        find_executable(fwd)->check_input(x);  // the hot path's input: another layout is another signature
        py::gil_scoped_release no_gil;
        return op.call(x, w, bias, fwd, bwd_data, bwd_filter);
      },
      py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("fwd"), py::arg("bwd_data"), py::arg("bwd_filter"),
      "torch.ops.convtune.tuned_conv called directly (unboxed): eager code's hot path, for plain tensors only "
      "(no __torch_function__ is consulted); unlike the op it raises ValueError for an input of other strides.");
  m.def("with_cudnn", &with_cudnn, "Whether this build has cuDNN plans.");
  m.def("set_poison", &set_poison, "Tests: results start as NaN (True) or uninitialised (False, the default).");
}
