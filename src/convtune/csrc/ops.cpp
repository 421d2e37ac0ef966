// The native convolution ops, their meta kernels, autocast and autograd: no Python on a tuned layer's
// forward or backward.
//
//   convtune::tuned_run(Tensor a, Tensor b, int executable) -> Tensor
//       one direction of one problem: fwd (x, w) -> y, bwd_data (dy, w) -> dx, bwd_filter (x, dy) -> dw.
//   convtune::tuned_conv(Tensor x, Tensor w, Tensor? bias, int fwd, int bwd_data, int bwd_filter) -> Tensor
//       a layer's forward convolution (plus bias), differentiable through the bwd_data and bwd_filter
//       executables (0: that gradient was not tuned, and asking for it raises ValueError).
//
// Under torch.compile, AOTAutograd traces tuned_conv's autograd into tuned_run calls (its meta kernel
// gives the result's shape and strides), which Inductor calls from its generated code.
#include "executable.h"
#include "layers.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>

namespace convtune {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The ops take operands of any strides and lay them out as the problem needs (a copy where they are not
// dense in its layout), as torch's own convolution does: Inductor may lower them on other layouts than the
// traced ones, and an exported program may be called with another layout. The module's hot path checks
// its input's layout before the op (the direct binding's check_input): there, an input of another layout is
// another signature, which the module tunes for itself.
at::Tensor run_executable(const at::Tensor& a, const at::Tensor& b, int64_t handle) {
  ExecutablePtr exe = find_executable(handle);
  exe->check(a, b, /*device=*/true, /*strides=*/false);
  // The executable computes in the problem's dtype: an autocast region around the model must not
  // recast the matrix products inside it.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  RECORD_FUNCTION(exe->geometry.label.c_str(), std::vector<c10::IValue>());
  const at::Tensor da = laid_out(a, exe->geometry.a), db = laid_out(b, exe->geometry.b);
  if (a.is_cuda()) {
    c10::OptionalDeviceGuard guard(a.device());
    return exe->run(da, db);
  }
  return exe->run(da, db);
}

at::Tensor run_meta(const at::Tensor& a, const at::Tensor& b, int64_t handle) {
  ExecutablePtr exe = find_executable(handle);
  exe->check(a, b, /*device=*/false, /*strides=*/false);
  return exe->empty_result(a);
}

// Each of tuned_conv's handles must be an executable of its slot's direction (0: an untuned gradient): one of
// another direction on operands of the same shapes (a 1x1 layer with as many channels in as out) would compute
// another thing without a word.
void check_direction(int64_t handle, Direction slot) {
  static const char* names[3] = {"forward", "data gradient", "weight gradient"};
  if (handle == 0 && slot != Direction::Fwd) return;
  const ExecutablePtr exe = find_executable(handle);
  const Geometry& g = exe->geometry;
  TORCH_CHECK_VALUE(g.direction == slot, g.label, ": handle ", text(handle), " is given as the ",
                    names[static_cast<int>(slot)], "'s, but its executable computes the ",
                    names[static_cast<int>(g.direction)]);
}

// The forward: the convolution (tuned_run checks the operands, then lays them out as the problem needs,
// the weight as torch's own convolution converts it), then the bias.
at::Tensor conv_forward(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t fwd) {
  check_direction(fwd, Direction::Fwd);  // here, where every path passes (inference_mode skips the autograd kernel)
  at::Tensor y = run_tuned(x, w, fwd);
  add_bias(y, bias, [fwd] { return find_executable(fwd)->geometry.label; });
  return y;
}

struct TunedConv : public torch::autograd::Function<TunedConv> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias, int64_t fwd, int64_t bwd_data, int64_t bwd_filter) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["bwd_data"] = bwd_data;
    ctx->saved_data["bwd_filter"] = bwd_filter;
    ctx->saved_data["bias"] = bias.has_value() && bias->defined();  // an absent bias has no input edge
    // apply() runs this with gradients off: tuned_run's autograd kernel would only pass the call on.
    at::AutoDispatchBelowADInplaceOrView below;
    return conv_forward(x, w, bias, fwd);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    at::Tensor dy = grads[0];
    at::Tensor dx, dw, db;
    // With gradients off (no create_graph), tuned_run's autograd kernel would only pass the calls on; with
    // them on, it is called, and raises: a tuned layer has no double backward.
    std::optional<at::AutoDispatchBelowADInplaceOrView> below;
    if (!at::GradMode::is_enabled()) below.emplace();
    const int64_t bwd_data = ctx->saved_data["bwd_data"].toInt(), bwd_filter = ctx->saved_data["bwd_filter"].toInt();
    const bool data_grad = ctx->needs_input_grad(0), weight_grad = ctx->needs_input_grad(1);
    // tuned_run lays its operands out as the problem needs; where both gradients read dy, once here.
    if (data_grad && weight_grad) dy = gradient_for_both(dy, bwd_data, bwd_filter);
    if (data_grad) dx = run_tuned(dy, w, bwd_data);
    if (weight_grad) dw = run_tuned(x, dy, bwd_filter);
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) {
      std::vector<int64_t> dims{0};
      for (int64_t d = 2; d < dy.dim(); ++d) dims.push_back(d);
      db = dy.sum(dims);
    }
    return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void check_gradient_tuned(const char* name, bool needed, int64_t handle, int64_t fwd) {
  TORCH_CHECK_VALUE(!needed || handle != 0, find_executable(fwd)->geometry.label, ": the gradient of ", name,
                    " is needed but its direction was not tuned; let the layer tune it (call it with "
                    "requires_grad inputs, or convtune.optimize(..., training=True))");
}

at::Tensor conv_autograd(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t fwd,
                         int64_t bwd_data, int64_t bwd_filter) {
  if (under_transform()) {  // (torch.func: PyTorch's convolution, which its transforms know)
    const Geometry& g = find_executable(fwd)->geometry;
    return torch_convolution(x, w, bias, g);
  }
  TORCH_CHECK_NOT_IMPLEMENTED(!has_tangent(x, w, bias), find_executable(fwd)->geometry.label,
                              ": convtune::tuned_conv has no forward-mode derivative (torch.autograd.forward_ad), so "
                              "the tangent would be lost; run that model on torch's convolutions");
  const bool bias_grad = bias.has_value() && bias->defined() && bias->requires_grad();
  if (!at::GradMode::is_enabled() || !(x.requires_grad() || w.requires_grad() || bias_grad)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return conv_forward(x, w, bias, fwd);
  }
  check_direction(bwd_data, Direction::BwdData);
  check_direction(bwd_filter, Direction::BwdFilter);
  check_gradient_tuned("the input", x.requires_grad(), bwd_data, fwd);
  check_gradient_tuned("the weight", w.requires_grad(), bwd_filter, fwd);
  return TunedConv::apply(x, w, bias, fwd, bwd_data, bwd_filter);
}

at::Tensor conv_below_autograd(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                               int64_t fwd, int64_t bwd_data, int64_t bwd_filter) {
  return conv_forward(x, w, bias, fwd);
}

// tuned_run has no derivative of its own: tuned_conv's backward calls it (with gradients off, so this
// is one redispatch), and asking for its gradient (double backward through a tuned layer, or a call with an
// operand that requires grad) raises, naming the operand.
at::Tensor run_autograd(const at::Tensor& a, const at::Tensor& b, int64_t handle) {
  if (at::GradMode::is_enabled() && (a.requires_grad() || b.requires_grad())) {
    const Geometry& g = find_executable(handle)->geometry;
    TORCH_CHECK_NOT_IMPLEMENTED(false, g.label, ": convtune::tuned_run has no derivative, yet its operand ",
                                operand_name(g.direction, a.requires_grad() ? 0 : 1),
                                " requires grad: a tuned layer has no double backward (create_graph=True); call "
                                "tuned_run under torch.no_grad(), or run that model on torch's convolutions");
  }
  at::AutoDispatchBelowADInplaceOrView below;
  return run_tuned(a, b, handle);
}

template <c10::DeviceType device_type>
at::Tensor conv_autocast(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t fwd,
                         int64_t bwd_data, int64_t bwd_filter) {
  // As autocast treats torch's convolutions: the operands in the region's dtype (weights cast once
  // per region through its cache), float64 left alone.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  const auto dtype = at::autocast::get_autocast_dtype(device_type);
  return conv_tuned(at::autocast::cached_cast(dtype, x, device_type), at::autocast::cached_cast(dtype, w, device_type),
                    at::autocast::cached_cast(dtype, bias, device_type), fwd, bwd_data, bwd_filter);
}

}  // namespace

at::Tensor run_tuned(const at::Tensor& a, const at::Tensor& b, int64_t handle) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("convtune::tuned_run", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  return op.call(a, b, handle);
}

at::Tensor conv_tuned(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t fwd,
                      int64_t bwd_data, int64_t bwd_filter) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("convtune::tuned_conv", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         int64_t, int64_t, int64_t)>();
  return op.call(x, w, bias, fwd, bwd_data, bwd_filter);
}

bool has_tangent(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return x._fw_grad(0).defined() || w._fw_grad(0).defined() ||
         (bias.has_value() && bias->defined() && bias->_fw_grad(0).defined());
}

bool under_transform() {
  return c10::impl::tls_local_dispatch_key_set().included_.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode);
}

at::Tensor torch_convolution(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                             at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  if (x.dim() == 3) return at::conv1d(x, w, bias, stride, padding, dilation, groups);
  if (x.dim() == 4) return at::conv2d(x, w, bias, stride, padding, dilation, groups);
  return at::conv3d(x, w, bias, stride, padding, dilation, groups);
}

at::Tensor torch_convolution(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                             const Geometry& g) {
  return torch_convolution(x, w, bias, g.stride, g.padding, g.dilation, g.groups);
}

TORCH_LIBRARY_FRAGMENT(convtune, m) {
  m.def("tuned_run(Tensor a, Tensor b, int executable) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("tuned_conv(Tensor x, Tensor w, Tensor? bias, int fwd, int bwd_data, int bwd_filter) -> Tensor",
        {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(convtune, CPU, m) {
  m.impl("tuned_run", &run_executable);
  m.impl("tuned_conv", &conv_below_autograd);
}

TORCH_LIBRARY_IMPL(convtune, CUDA, m) {
  m.impl("tuned_run", &run_executable);
  m.impl("tuned_conv", &conv_below_autograd);
}

TORCH_LIBRARY_IMPL(convtune, Meta, m) {
  m.impl("tuned_run", &run_meta);
  m.impl("tuned_conv", &conv_below_autograd);
}

TORCH_LIBRARY_IMPL(convtune, Autograd, m) {
  m.impl("tuned_conv", &conv_autograd);
  m.impl("tuned_run", &run_autograd);
}

TORCH_LIBRARY_IMPL(convtune, AutocastCPU, m) { m.impl("tuned_conv", &conv_autocast<c10::DeviceType::CPU>); }

TORCH_LIBRARY_IMPL(convtune, AutocastCUDA, m) { m.impl("tuned_conv", &conv_autocast<c10::DeviceType::CUDA>); }

}  // namespace convtune
