// convtune._C: the control plane's door to the executables (the ops themselves register in ops.cpp).
#include <ATen/autocast_mode.h>
#include <torch/extension.h>

#include "executable.h"
#include "layers.h"

namespace py = pybind11;

namespace convtune {
namespace {

at::ScalarType scalar_type(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "uint8") return at::kByte;
  if (name == "float64") return at::kDouble;
  TORCH_CHECK_VALUE(false, "convtune: dtype ", name, " is none of float32, float16, bfloat16, uint8, float64");
}

Geometry geometry(int64_t direction, const std::string& dtype, const std::string& device, bool channels_last,
                  bool allow_tf32, int64_t groups, std::vector<int64_t> stride, std::vector<int64_t> padding,
                  std::vector<int64_t> dilation, std::vector<std::vector<int64_t>> shapes,
                  std::vector<std::vector<int64_t>> strides, std::string label) {
  TORCH_CHECK_VALUE(direction >= 0 && direction <= 2, "convtune: direction ", text(direction), " is not 0, 1 or 2");
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

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kDouble: return "float64";
    default: return c10::toString(t);
  }
}

LayerEntry layer_entry(const std::vector<int64_t>& handles, const std::vector<bool>& tuned) {
  TORCH_CHECK_VALUE(handles.size() == 3 && tuned.size() == 3, "convtune: a layer entry has three handles and three "
                    "flags (fwd, bwd_data, bwd_filter)");
  LayerEntry e;
  for (int i = 0; i < 3; ++i) {
    e.handles[i] = handles[i];
    e.tuned[i] = tuned[i];
  }
  return e;
}

// The control plane's tuner as layers.cpp calls it: with the GIL, and never letting a Python error through
// (a failing tuner is the control plane's to report; the call then runs PyTorch's convolution).
LayerTuner python_tuner(py::object callable) {
  auto* held = new py::object(std::move(callable));  // never freed: a Python object must not die without the GIL
  return [held](int64_t id, const at::Tensor& x, const at::Tensor& w, bool need_dx, bool need_dw, LayerEntry* entry) {
    py::gil_scoped_acquire gil;
    try {
      py::object answer = (*held)(id, x, w, need_dx, need_dw);
      if (answer.is_none()) return false;
      auto [handles, tuned] = answer.cast<std::tuple<std::vector<int64_t>, std::vector<bool>>>();
      *entry = layer_entry(handles, tuned);
      return true;
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable(__func__);
      return false;
    } catch (const std::exception& e) {  // an answer of the wrong form: reported as Python reports such errors
      PyErr_SetString(PyExc_TypeError, e.what());
      PyErr_WriteUnraisable(nullptr);
      return false;
    }
  };
}

// Eager code's hot path of a layer whose choice for its input is PyTorch's own call: the checks the module's
// Python hot path made (TorchCall.admits), in C++, then PyTorch's convolution as torch.nn's forward calls it
// (aten::conv1d/2d/3d through the dispatcher: PyTorch's autograd, double backward included, autocast and cuDNN
// flags). ``fwd``: a torch:native executable of the problem chosen for, whose geometry says the input's shape,
// layout, device type and (autocast's, under autocast) dtype, and the weight's shape; dx_tuned, dw_tuned: whether
// the gradients were chosen for. ValueError where the input is not of that signature, the weight of another shape
// (a new Parameter, its .data replaced) or a gradient not chosen for is needed (the module then selects for it, and
// tunes again for a new weight); nothing else differs from torch.nn's forward. ``inference``: the executable of
// the problem's forward that a call needing no gradient runs instead (through tuned_conv, as the layer's op would
// run it), where its path costs the layer less than PyTorch's call; 0: PyTorch's call whatever the call needs. Like
// every executable it computes as tuned: cuDNN's flags set after tuning (allow_tf32, deterministic) do not reach it.
at::Tensor torch_conv(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t fwd,
                      bool dx_tuned, bool dw_tuned, int64_t inference) {
  const ExecutablePtr e = find_executable(fwd);
  const Geometry& g = e->geometry;
  if (under_transform()) return torch_convolution(x, w, bias, g);  // torch.func
  e->check_input(x);
  TORCH_CHECK_VALUE(w.sizes() == at::IntArrayRef(g.b.shape), g.label, ": weight of shape ", text(w.sizes()),
                    " is not the tuned problem's (", text(g.b.shape), ")");
  TORCH_CHECK_VALUE(x.device().type() == g.device_type, g.label, ": input x is on ", x.device().str(),
                    ", the problem chosen for is on ", c10::DeviceTypeName(g.device_type, true));
  const bool cast = at::autocast::is_autocast_enabled(g.device_type);
  const at::ScalarType dtype = cast ? at::autocast::get_autocast_dtype(g.device_type) : x.scalar_type();
  TORCH_CHECK_VALUE(dtype == g.dtype, g.label, ": input x computes in ", dtype_name(dtype),
                    ", the problem chosen for in ", dtype_name(g.dtype));
  const bool grad = at::GradMode::is_enabled();
  TORCH_CHECK_VALUE(dx_tuned || !(grad && x.requires_grad()), g.label, ": the input's gradient was not chosen for");
  TORCH_CHECK_VALUE(dw_tuned || !(grad && w.requires_grad()), g.label, ": the weight's gradient was not chosen for");
  const bool bias_grad = bias.has_value() && bias->defined() && bias->requires_grad();
  // (a forward-mode tangent needs PyTorch's convolution: the op has no such derivative)
  if (inference != 0 && !(grad && (x.requires_grad() || w.requires_grad() || bias_grad)) && !has_tangent(x, w, bias)) {
    py::gil_scoped_release no_gil;
    return conv_tuned(x, w, bias, inference, 0, 0);  // (whose forward checks that the executable computes one)
  }
  py::gil_scoped_release no_gil;
  return torch_convolution(x, w, bias, g);
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
        std::string plan(serialized);
        // cuDNN's heuristics and the plan's build take milliseconds: other Python threads run meanwhile (the
        // background worker makes executables while the training loop runs)
        py::gil_scoped_release no_gil;
        add_executable(handle, description, make_cudnn(g, std::move(spec), std::move(plan)));
      },
      "A cuDNN execution plan: from its serialized form, else the one of cuDNN's heuristics with the tag (the frontend's plan name).");
  m.def(
      "add_cubin",
      [](int64_t handle, const std::string& description, const Geometry& g, int64_t device_index,
         const std::vector<std::tuple<std::string, std::vector<int64_t>, std::string>>& buffers,
         const std::vector<std::tuple<std::string, py::bytes, int64_t, int64_t, std::vector<int64_t>,
                                      std::vector<std::tuple<std::string, std::string, int64_t, double>>>>& launches) {
        std::vector<BufferSpec> specs;
        for (const auto& [name, shape, dtype] : buffers) specs.push_back(BufferSpec{name, shape, scalar_type(dtype)});
        std::vector<CubinLaunch> recorded;
        for (const auto& [name, binary, shared, warps, grid, params] : launches) {
          CubinLaunch launch{name, std::string(binary), shared, warps, grid, {}};
          for (const auto& [type, operand, integer, real] : params) launch.params.push_back({type, operand, integer, real});
          recorded.push_back(std::move(launch));
        }
        py::gil_scoped_release no_gil;  // loading the binaries into the driver: other Python threads run meanwhile
        add_executable(handle, description, make_cubin(g, device_index, std::move(specs), std::move(recorded)));
      },
      "convtune's Triton kernels launched from C++: the recorded launches (name, binary, shared memory, warps, grid, "
      "[(type, operand, integer, real)]) over the operands and the buffers declared.");
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
        const ExecutablePtr e = find_executable(fwd);
        if (under_transform()) {  // torch.func's wrapped tensors: PyTorch's convolution, which its transforms know
          const Geometry& g = e->geometry;
          return torch_convolution(x, w, bias, g);
        }
        e->check_input(x);  // the hot path's input: another layout is another signature
        py::gil_scoped_release no_gil;
        return conv_tuned(x, w, bias, fwd, bwd_data, bwd_filter);
      },
      py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("fwd"), py::arg("bwd_data"), py::arg("bwd_filter"),
      "torch.ops.convtune.tuned_conv called directly (unboxed): eager code's hot path, for plain tensors only "
      "(no __torch_function__ is consulted); unlike the op it raises ValueError for an input of other strides.");
  m.def("under_transform", &under_transform,
        "Whether a torch.func transform (grad, vjp, vmap, jacrev, jvp) is active on this thread: a tuned layer then "
        "calls PyTorch's convolution, which the transforms know.");
  m.def("torch_conv", &torch_conv, py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("fwd"), py::arg("dx_tuned"),
        py::arg("dw_tuned"), py::arg("inference") = 0,
        "PyTorch's convolution for an input of the signature the torch:native executable fwd was made for (eager "
        "code's hot path of a layer whose choice is PyTorch's call), or, for a call that needs no gradient, the "
        "forward executable inference where one is given; ValueError for any other input.");
  m.def("layer_new", &layer_new, py::arg("stride"), py::arg("padding"), py::arg("dilation"), py::arg("groups"),
        py::arg("weight_shape"),
        "A new layer of this geometry and weight shape (its id) for torch.ops.convtune.layer_conv, with an empty table.");
  m.def("layer_drop", &layer_drop, "Forget a layer and its table (an unknown id: nothing).");
  m.def(
      "layer_set",
      [](int64_t id, const std::vector<int64_t>& shape, const std::string& dtype, const std::string& device,
         bool channels_last, const std::vector<int64_t>& handles, const std::vector<bool>& tuned) {
        layer_set(id, shape, scalar_type(dtype), at::Device(device), channels_last, layer_entry(handles, tuned));
      },
      py::arg("layer"), py::arg("shape"), py::arg("dtype"), py::arg("device"), py::arg("channels_last"),
      py::arg("handles"), py::arg("tuned"),
      "What a layer runs for one input signature: the handles (fwd, bwd_data, bwd_filter; 0: PyTorch's call) "
      "and which directions were selected for.");
  m.def(
      "layer_forget",
      [](int64_t id, const std::vector<int64_t>& shape, const std::string& dtype, const std::string& device,
         bool channels_last) { layer_forget(id, shape, scalar_type(dtype), at::Device(device), channels_last); },
      py::arg("layer"), py::arg("shape"), py::arg("dtype"), py::arg("device"), py::arg("channels_last"),
      "Drop a layer's entry for one input signature (the next call asks the tuner again).");
  m.def(
      "layer_entries",
      [](int64_t id) {
        py::list out;
        for (const auto& [shape, dtype, device, channels_last, e] : layer_entries(id)) {
          out.append(py::make_tuple(shape, dtype_name(dtype), device.str(), channels_last,
                                    std::vector<int64_t>(e.handles, e.handles + 3), std::vector<bool>(e.tuned, e.tuned + 3)));
        }
        return out;
      },
      "Every signature of a layer's table: (shape, dtype, device, channels_last, handles, tuned).");
  m.def(
      "set_layer_tuner", [](py::object callable) { set_layer_tuner(callable.is_none() ? LayerTuner() : python_tuner(callable)); },
      "The callable (layer, x, w, need_dx, need_dw) -> (handles, tuned) or None that layers ask for a signature "
      "their table lacks (None: no tuner, PyTorch's call runs).");
  m.def("with_cudnn", &with_cudnn, "Whether this build has cuDNN plans.");
  m.def("with_cubin", &with_cubin, "Whether this build launches Triton's compiled kernels (executable kind 'cubin').");
  m.def("set_poison", &set_poison, "Tests: results start as NaN (True) or uninitialised (False, the default).");
}
