// Layers: what compiled code calls for a tuned module, whatever shape its input has.
//
//   convtune::layer_conv(Tensor x, Tensor w, Tensor? bias, int[] stride, int[] padding, int[] dilation,
//                        int groups, int layer, bool need_dx, bool need_dw) -> Tensor
//       the module's forward convolution (plus bias), differentiable; below autograd it is
//   convtune::layer_run(Tensor x, Tensor w, int[] stride, int[] padding, int[] dilation, int groups, int layer,
//                       bool need_dx, bool need_dw) -> Tensor
//   convtune::layer_backward(Tensor dy, Tensor x, Tensor w, <the same geometry>, int layer) -> (Tensor, Tensor)
//       both gradients (where both are needed: one call from compiled code, one lookup of the table, and one
//       at::convolution_backward where both directions are PyTorch's), or one:
//   convtune::layer_backward_data(Tensor dy, Tensor x, Tensor w, <the same geometry>, int layer) -> Tensor
//   convtune::layer_backward_filter(Tensor dy, Tensor x, Tensor w, <the same geometry>, int layer) -> Tensor
//
// The convolution's geometry travels in the call, so a graph says everything it computes (a compiled
// graph cached for one geometry is never served for another) and its meta kernels need no state. A
// layer (an id from layer_new) holds one module's table from input signature (shape, dtype, device,
// layout) to the executables chosen for it (tuned_run's handles). Each call looks its input's signature
// up. One the table lacks (a shape met first in compiled code) asks the control plane's tuner, which
// selects for it (measuring, as a module's first call does) and answers its handles, kept from then on;
// where there is no answer, or a direction chose PyTorch's call, or the layer is gone or has another
// geometry (a graph compiled in another process), PyTorch's convolution runs. The meta kernels compute
// the result from symbolic sizes, so a graph traced with dynamic shapes calls the op for every shape,
// with no recompilation and no graph break. The result is dense in the memory format PyTorch suggests for
// the operand it takes its shape from (x for the forward and the data gradient, w for the weight
// gradient), the same for every path.
#include "layers.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>
#include <pthread.h>

#include <array>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <shared_mutex>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "executable.h"

namespace convtune {

namespace {

// A convolution's geometry, as the ops receive it and a layer keeps it.
struct ConvGeometry {
  std::vector<int64_t> stride, padding, dilation;
  int64_t groups = 1;
  bool operator==(const ConvGeometry& o) const {
    return stride == o.stride && padding == o.padding && dilation == o.dilation && groups == o.groups;
  }
};

// Raises ValueError unless the geometry is one a convolution of ``dims`` spatial dimensions can have.
ConvGeometry geometry_of(at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                      int64_t dims) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(stride.size()) == dims && padding.size() == stride.size() &&
                        dilation.size() == stride.size(),
                    "convtune: a layer op needs one stride, padding and dilation per spatial dimension (",
                    text(dims), "), got ", text(stride), ", ", text(padding), ", ", text(dilation));
  for (size_t i = 0; i < stride.size(); ++i) {
    TORCH_CHECK_VALUE(stride[i] > 0 && dilation[i] > 0 && padding[i] >= 0,
                      "convtune: a layer needs strides and dilations above 0 and paddings of at least 0, got stride ",
                      text(stride), ", padding ", text(padding), ", dilation ", text(dilation));
  }
  TORCH_CHECK_VALUE(groups > 0, "convtune: a layer needs groups above 0, got ", text(groups));
  return ConvGeometry{stride.vec(), padding.vec(), dilation.vec(), groups};
}

ConvGeometry geometry_for(const at::Tensor& x, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                       int64_t groups) {
  TORCH_CHECK_VALUE(x.dim() >= 3 && x.dim() <= 5, "convtune: a layer op takes a batched 1-D, 2-D or 3-D input, got ",
                    text(x.dim()), " dimensions");
  return geometry_of(stride, padding, dilation, groups, x.dim() - 2);
}

struct Layer {
  ConvGeometry geometry;
  std::vector<int64_t> weight_shape;  // with the geometry, what the layer computes: its table holds nothing else
  std::shared_mutex mutex;  // guards table
  std::unordered_map<std::string, LayerEntry> table;
};

std::mutex layers_mutex;  // guards layers(), next_layer and the tuner
int64_t next_layer = 1;
std::unordered_map<int64_t, std::shared_ptr<Layer>>& layers() {
  static auto* all = new std::unordered_map<int64_t, std::shared_ptr<Layer>>();  // never freed: ops may run at exit
  return *all;
}
LayerTuner& tuner() {
  static auto* t = new LayerTuner();  // never destroyed: it holds a Python callable
  return *t;
}

// As the registry's lock (registry.cpp): fork takes the layers' locks first, each layer's after the list's (no thread
// holds a layer's while it waits for the list's); the parent releases them after, the child starts with new ones.
void lock_layers_for_fork() {
  layers_mutex.lock();
  for (auto& [id, layer] : layers()) layer->mutex.lock();
}
void unlock_layers_after_fork() {
  for (auto& [id, layer] : layers()) layer->mutex.unlock();
  layers_mutex.unlock();
}
void renew_layers_after_fork() {
  for (auto& [id, layer] : layers()) new (&layer->mutex) std::shared_mutex();
  new (&layers_mutex) std::mutex();
}
const int layers_fork_handlers = pthread_atfork(lock_layers_for_fork, unlock_layers_after_fork, renew_layers_after_fork);

// The layer ``id``, or none.
std::shared_ptr<Layer> lookup(int64_t id) {
  std::lock_guard<std::mutex> lock(layers_mutex);
  auto found = layers().find(id);
  return found == layers().end() ? nullptr : found->second;
}

std::shared_ptr<Layer> find_layer(int64_t id) {
  std::shared_ptr<Layer> layer = lookup(id);
  TORCH_CHECK_VALUE(layer, "convtune: no layer has id ", text(id), " in this process");
  return layer;
}

// The layer ``id`` where it exists and computes ``geometry`` with a weight of ``w``'s shape; else none (the op
// then runs PyTorch's call: a graph compiled in another process may name another layer by that id).
std::shared_ptr<Layer> layer_for(int64_t id, const ConvGeometry& geometry, const at::Tensor& w) {
  std::shared_ptr<Layer> layer = lookup(id);
  if (!layer || !(layer->geometry == geometry) || !w.sizes().equals(layer->weight_shape)) return nullptr;
  return layer;
}

// The table's key: the shape, dtype, device and layout, as bytes.
std::string signature_key(at::IntArrayRef shape, at::ScalarType dtype, at::Device device, bool channels_last) {
  std::string key;
  key.reserve(sizeof(int64_t) * shape.size() + 4);
  for (int64_t s : shape) key.append(reinterpret_cast<const char*>(&s), sizeof s);
  key.push_back(static_cast<char>(dtype));
  key.push_back(static_cast<char>(device.type()));
  key.push_back(static_cast<char>(device.index()));
  key.push_back(channels_last ? 1 : 0);
  return key;
}

// As the control plane's layout_of: channels_last for a tensor dense in that order only (4-D and 5-D: the
// tensor's own flags, which PyTorch keeps; 3-D: its strides against the (N, L, C) order).
bool channels_last_of(const at::Tensor& t) {
  if (t.dim() == 4 || t.dim() == 5) {
    return t.is_contiguous(t.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d) &&
           !t.is_contiguous();
  }
  if (t.dim() != 3 || t.is_contiguous()) return false;
  const std::vector<int64_t> shape = t.sizes().vec();
  return fits(t, Spec{shape, dense_strides(shape, true)});
}

// The tuner's answer. The ops run below autograd (its keys excluded, gradients off) and, under autocast, with
// autocast's keys excluded; the selection the tuner makes (measuring, building executables) runs with autograd
// on and autocast off, as convtune measures everywhere.
bool ask_tuner(int64_t id, const at::Tensor& x, const at::Tensor& w, bool need_dx, bool need_dw, LayerEntry* answer) {
  LayerTuner ask;
  {
    std::lock_guard<std::mutex> lock(layers_mutex);
    ask = tuner();
  }
  if (!ask) return false;
  c10::impl::LocalDispatchKeySet state = c10::impl::tls_local_dispatch_key_set();
  c10::impl::ForceDispatchKeyGuard plain(state.included_,
                                         (state.excluded_ - c10::autograd_dispatch_keyset_with_ADInplaceOrView) |
                                             c10::autocast_dispatch_keyset);
  c10::InferenceMode no_inference_mode(false);  // a compiled call under inference_mode: measuring is not inference
  at::AutoGradMode grad(true);
  return ask(id, x, w, need_dx, need_dw, answer);
}

// The entry for ``x``'s signature that covers the directions needed, from the layer's table or else the tuner;
// an empty entry (PyTorch's call) where neither has one or there is no such layer.
LayerEntry entry_for(int64_t id, const ConvGeometry& geometry, const at::Tensor& x, const at::Tensor& w, bool need_dx,
                     bool need_dw) {
  std::shared_ptr<Layer> layer = layer_for(id, geometry, w);
  if (!layer) return LayerEntry{};
  const std::string key = signature_key(x.sizes(), x.scalar_type(), x.device(), channels_last_of(x));
  std::optional<LayerEntry> known;
  {
    std::shared_lock<std::shared_mutex> lock(layer->mutex);
    auto found = layer->table.find(key);
    if (found != layer->table.end()) known = found->second;
  }
  if (known && known->tuned[0] && (known->tuned[1] || !need_dx) && (known->tuned[2] || !need_dw)) return *known;
  LayerEntry answer;
  if (ask_tuner(id, x, w, need_dx, need_dw, &answer)) {
    std::unique_lock<std::shared_mutex> lock(layer->mutex);
    layer->table[key] = answer;
    return answer;
  }
  return known.value_or(LayerEntry{});
}

at::Tensor dense_like(const at::Tensor& t, const at::Tensor& like) { return t.contiguous(like.suggest_memory_format()); }

std::vector<int64_t> zeros_like(const std::vector<int64_t>& v) { return std::vector<int64_t>(v.size(), 0); }

at::Tensor run_layer(const at::Tensor& x, const at::Tensor& w, at::IntArrayRef stride, at::IntArrayRef padding,
                     at::IntArrayRef dilation, int64_t groups, int64_t id, bool need_dx, bool need_dw) {
  const ConvGeometry g = geometry_for(x, stride, padding, dilation, groups);
  const LayerEntry e = entry_for(id, g, x, w, need_dx, need_dw);
  if (e.handles[0]) return dense_like(run_tuned(x, w, e.handles[0]), x);
  return dense_like(at::convolution(x, w, std::nullopt, g.stride, g.padding, g.dilation, false, zeros_like(g.stride),
                                    g.groups),
                    x);
}

// A gradient (the data gradient where ``data``, else the weight gradient) by the entry's executable for it, else
// PyTorch's; dense like the operand whose shape it has.
// PyTorch's gradients of the convolution, those ``mask`` (input, weight) asks for.
std::tuple<at::Tensor, at::Tensor> torch_gradients(const ConvGeometry& g, const at::Tensor& dy, const at::Tensor& x,
                                                   const at::Tensor& w, std::array<bool, 2> mask) {
  auto grads = at::convolution_backward(dy, x, w, std::nullopt, g.stride, g.padding, g.dilation, false,
                                        zeros_like(g.stride), g.groups, {mask[0], mask[1], false});
  return {std::get<0>(grads), std::get<1>(grads)};
}

at::Tensor one_gradient(bool data, const LayerEntry& e, const ConvGeometry& g, const at::Tensor& dy, const at::Tensor& x,
                        const at::Tensor& w) {
  const at::Tensor& like = data ? x : w;
  if (const int64_t handle = e.handles[data ? 1 : 2]) {
    return dense_like(data ? run_tuned(dy, w, handle) : run_tuned(x, dy, handle), like);
  }
  auto [dx, dw] = torch_gradients(g, dy, x, w, {data, !data});
  return dense_like(data ? dx : dw, like);
}

template <bool data>
at::Tensor run_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, at::IntArrayRef stride,
                        at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, int64_t id) {
  const ConvGeometry g = geometry_for(x, stride, padding, dilation, groups);
  return one_gradient(data, entry_for(id, g, x, w, data, !data), g, dy, x, w);
}

// Both gradients: PyTorch's in one call where both directions chose it; else each by its own path, dy laid out
// once where both executables read it in one layout.
std::tuple<at::Tensor, at::Tensor> run_backward_both(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                     at::IntArrayRef stride, at::IntArrayRef padding,
                                                     at::IntArrayRef dilation, int64_t groups, int64_t id) {
  const ConvGeometry g = geometry_for(x, stride, padding, dilation, groups);
  const LayerEntry e = entry_for(id, g, x, w, true, true);
  if (!e.handles[1] && !e.handles[2]) {
    auto [dx, dw] = torch_gradients(g, dy, x, w, {true, true});
    return {dense_like(dx, x), dense_like(dw, w)};
  }
  const at::Tensor d = e.handles[1] && e.handles[2] ? gradient_for_both(dy, e.handles[1], e.handles[2]) : dy;
  return {one_gradient(true, e, g, d, x, w), one_gradient(false, e, g, d, x, w)};
}

// Meta kernels: the result's shape from (possibly symbolic) sizes, in the memory format the real kernels give.
at::Tensor run_layer_meta(const at::Tensor& x, const at::Tensor& w, at::IntArrayRef stride, at::IntArrayRef padding,
                          at::IntArrayRef dilation, int64_t groups, int64_t, bool, bool) {
  const ConvGeometry g = geometry_for(x, stride, padding, dilation, groups);
  TORCH_CHECK_VALUE(w.dim() == x.dim(), "convtune: a layer op's weight has ", text(w.dim()), " dimensions, its input ",
                    text(x.dim()));
  std::vector<c10::SymInt> shape{x.sym_size(0), w.sym_size(0)};
  for (size_t i = 0; i < g.stride.size(); ++i) {
    const c10::SymInt extent = (w.sym_size(i + 2) - 1) * g.dilation[i] + 1;
    shape.push_back((x.sym_size(i + 2) + 2 * g.padding[i] - extent) / g.stride[i] + 1);
  }
  return at::empty_symint(shape, x.options(), x.suggest_memory_format());
}

template <bool data>
at::Tensor backward_meta(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, at::IntArrayRef stride,
                         at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, int64_t) {
  geometry_for(x, stride, padding, dilation, groups);
  const at::Tensor& like = data ? x : w;
  return at::empty_symint(like.sym_sizes(), dy.options(), like.suggest_memory_format());
}

std::tuple<at::Tensor, at::Tensor> backward_both_meta(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                      at::IntArrayRef stride, at::IntArrayRef padding,
                                                      at::IntArrayRef dilation, int64_t groups, int64_t id) {
  return {backward_meta<true>(dy, x, w, stride, padding, dilation, groups, id),
          backward_meta<false>(dy, x, w, stride, padding, dilation, groups, id)};
}

using Arrays = at::IntArrayRef;
using RunOp = at::Tensor(const at::Tensor&, const at::Tensor&, Arrays, Arrays, Arrays, int64_t, int64_t, bool, bool);
using BackwardOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, Arrays, Arrays, Arrays, int64_t,
                              int64_t);
using BothOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, Arrays,
                                                  Arrays, Arrays, int64_t, int64_t);
using ConvOp = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, Arrays, Arrays,
                          Arrays, int64_t, int64_t, bool, bool);

at::Tensor call_run(const at::Tensor& x, const at::Tensor& w, Arrays stride, Arrays padding, Arrays dilation,
                    int64_t groups, int64_t id, bool need_dx, bool need_dw) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("convtune::layer_run", "").typed<RunOp>();
  return op.call(x, w, stride, padding, dilation, groups, id, need_dx, need_dw);
}

at::Tensor call_backward(bool data, const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, Arrays stride,
                         Arrays padding, Arrays dilation, int64_t groups, int64_t id) {
  static auto data_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("convtune::layer_backward_data", "").typed<BackwardOp>();
  static auto filter_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("convtune::layer_backward_filter", "").typed<BackwardOp>();
  return (data ? data_op : filter_op).call(dy, x, w, stride, padding, dilation, groups, id);
}

std::tuple<at::Tensor, at::Tensor> call_backward_both(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                      Arrays stride, Arrays padding, Arrays dilation, int64_t groups,
                                                      int64_t id) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("convtune::layer_backward", "").typed<BothOp>();
  return op.call(dy, x, w, stride, padding, dilation, groups, id);
}

at::Tensor forward_below_autograd(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                                  Arrays stride, Arrays padding, Arrays dilation, int64_t groups, int64_t id,
                                  bool need_dx, bool need_dw) {
  at::Tensor y = call_run(x, w, stride, padding, dilation, groups, id, need_dx, need_dw);
  add_bias(y, bias, [id] { return "convtune: layer " + text(id); });
  return y;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct LayerConv : public torch::autograd::Function<LayerConv> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias, Arrays stride, Arrays padding, Arrays dilation,
                            int64_t groups, int64_t id, bool need_dx, bool need_dw) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["stride"] = stride.vec();
    ctx->saved_data["padding"] = padding.vec();
    ctx->saved_data["dilation"] = dilation.vec();
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["layer"] = id;
    ctx->saved_data["bias"] = bias.has_value() && bias->defined();
    at::AutoDispatchBelowADInplaceOrView below;
    return forward_below_autograd(x, w, bias, stride, padding, dilation, groups, id, need_dx, need_dw);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const std::vector<int64_t> stride = ctx->saved_data["stride"].toIntVector();
    const std::vector<int64_t> padding = ctx->saved_data["padding"].toIntVector();
    const std::vector<int64_t> dilation = ctx->saved_data["dilation"].toIntVector();
    const int64_t groups = ctx->saved_data["groups"].toInt(), id = ctx->saved_data["layer"].toInt();
    const at::Tensor& dy = grads[0];
    std::optional<at::AutoDispatchBelowADInplaceOrView> below;  // with gradients on, the ops' autograd kernel raises
    if (!at::GradMode::is_enabled()) below.emplace();
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0) && ctx->needs_input_grad(1)) {
      std::tie(dx, dw) = call_backward_both(dy, saved[0], saved[1], stride, padding, dilation, groups, id);
    } else if (ctx->needs_input_grad(0)) {
      dx = call_backward(true, dy, saved[0], saved[1], stride, padding, dilation, groups, id);
    } else if (ctx->needs_input_grad(1)) {
      dw = call_backward(false, dy, saved[0], saved[1], stride, padding, dilation, groups, id);
    }
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) {
      std::vector<int64_t> dims{0};
      for (int64_t d = 2; d < dy.dim(); ++d) dims.push_back(d);
      db = dy.sum(dims);
    }
    return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor conv_autograd(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, Arrays stride,
                         Arrays padding, Arrays dilation, int64_t groups, int64_t id, bool need_dx, bool need_dw) {
  if (under_transform()) return torch_convolution(x, w, bias, stride, padding, dilation, groups);  // (torch.func)
  TORCH_CHECK_NOT_IMPLEMENTED(!has_tangent(x, w, bias), "convtune's layer op has no forward-mode derivative "
                              "(torch.autograd.forward_ad), so the tangent would be lost; run that model on torch's "
                              "convolutions");
  const bool bias_grad = bias.has_value() && bias->defined() && bias->requires_grad();
  if (!at::GradMode::is_enabled() || !(x.requires_grad() || w.requires_grad() || bias_grad)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return forward_below_autograd(x, w, bias, stride, padding, dilation, groups, id, need_dx, need_dw);
  }
  return LayerConv::apply(x, w, bias, stride, padding, dilation, groups, id, need_dx || x.requires_grad(),
                          need_dw || w.requires_grad());
}

// The four inner ops have no derivative of their own (layer_conv's backward calls them): asking for one raises,
// naming the op and the operand. That is double backward through a tuned layer, or a graph traced below layer_conv's
// autograd (an exported program after run_decompositions) called with gradients on.
void no_double_backward(const char* op, std::initializer_list<std::pair<const char*, const at::Tensor*>> operands) {
  if (!at::GradMode::is_enabled()) return;
  for (const auto& [name, t] : operands) {
    TORCH_CHECK_NOT_IMPLEMENTED(!t->requires_grad(), "convtune::", op, " has no derivative, yet its operand ", name,
                                " requires grad: a tuned layer has no double backward (create_graph=True), and a graph "
                                "that calls convtune::", op, " itself (an exported program after run_decompositions) "
                                "runs under torch.no_grad() only; run that model on torch's convolutions");
  }
}

at::Tensor run_autograd(const at::Tensor& x, const at::Tensor& w, Arrays stride, Arrays padding, Arrays dilation,
                        int64_t groups, int64_t id, bool need_dx, bool need_dw) {
  no_double_backward("layer_run", {{"x", &x}, {"w", &w}});
  at::AutoDispatchBelowADInplaceOrView below;
  return call_run(x, w, stride, padding, dilation, groups, id, need_dx, need_dw);
}

template <bool data>
at::Tensor backward_autograd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, Arrays stride,
                             Arrays padding, Arrays dilation, int64_t groups, int64_t id) {
  no_double_backward(data ? "layer_backward_data" : "layer_backward_filter", {{"dy", &dy}, {"x", &x}, {"w", &w}});
  at::AutoDispatchBelowADInplaceOrView below;
  return call_backward(data, dy, x, w, stride, padding, dilation, groups, id);
}

std::tuple<at::Tensor, at::Tensor> backward_both_autograd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                          Arrays stride, Arrays padding, Arrays dilation, int64_t groups,
                                                          int64_t id) {
  no_double_backward("layer_backward", {{"dy", &dy}, {"x", &x}, {"w", &w}});
  at::AutoDispatchBelowADInplaceOrView below;
  return call_backward_both(dy, x, w, stride, padding, dilation, groups, id);
}

template <c10::DeviceType device_type>
at::Tensor conv_autocast(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, Arrays stride,
                         Arrays padding, Arrays dilation, int64_t groups, int64_t id, bool need_dx, bool need_dw) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  const auto dtype = at::autocast::get_autocast_dtype(device_type);
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("convtune::layer_conv", "").typed<ConvOp>();
  return op.call(at::autocast::cached_cast(dtype, x, device_type), at::autocast::cached_cast(dtype, w, device_type),
                 at::autocast::cached_cast(dtype, bias, device_type), stride, padding, dilation, groups, id, need_dx,
                 need_dw);
}

}  // namespace

int64_t layer_new(std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation,
                  int64_t groups, std::vector<int64_t> weight_shape) {
  auto layer = std::make_shared<Layer>();
  layer->geometry = geometry_of(stride, padding, dilation, groups, static_cast<int64_t>(stride.size()));
  TORCH_CHECK_VALUE(!stride.empty() && stride.size() <= 3, "convtune: a layer has 1 to 3 spatial dimensions, got ",
                    text(static_cast<int64_t>(stride.size())));
  TORCH_CHECK_VALUE(weight_shape.size() == stride.size() + 2, "convtune: a layer's weight shape has ",
                    text(static_cast<int64_t>(stride.size() + 2)), " dimensions, got ", text(weight_shape));
  layer->weight_shape = std::move(weight_shape);
  std::lock_guard<std::mutex> lock(layers_mutex);
  const int64_t id = next_layer++;
  layers().emplace(id, std::move(layer));
  return id;
}

void layer_drop(int64_t id) {
  std::lock_guard<std::mutex> lock(layers_mutex);
  layers().erase(id);
}

void layer_set(int64_t id, const std::vector<int64_t>& shape, at::ScalarType dtype, at::Device device,
               bool channels_last, const LayerEntry& entry) {
  auto layer = find_layer(id);
  std::unique_lock<std::shared_mutex> lock(layer->mutex);
  layer->table[signature_key(shape, dtype, device, channels_last)] = entry;
}

void layer_forget(int64_t id, const std::vector<int64_t>& shape, at::ScalarType dtype, at::Device device,
                  bool channels_last) {
  auto layer = find_layer(id);
  std::unique_lock<std::shared_mutex> lock(layer->mutex);
  layer->table.erase(signature_key(shape, dtype, device, channels_last));
}

std::vector<std::tuple<std::vector<int64_t>, at::ScalarType, at::Device, bool, LayerEntry>> layer_entries(int64_t id) {
  auto layer = find_layer(id);
  std::shared_lock<std::shared_mutex> lock(layer->mutex);
  std::vector<std::tuple<std::vector<int64_t>, at::ScalarType, at::Device, bool, LayerEntry>> out;
  for (const auto& [key, entry] : layer->table) {  // the key read back as signature_key wrote it
    const size_t dims = (key.size() - 4) / sizeof(int64_t);
    std::vector<int64_t> shape(dims);
    std::memcpy(shape.data(), key.data(), dims * sizeof(int64_t));
    const char* tail = key.data() + dims * sizeof(int64_t);
    out.emplace_back(shape, static_cast<at::ScalarType>(tail[0]),
                     at::Device(static_cast<at::DeviceType>(tail[1]), static_cast<at::DeviceIndex>(tail[2])),
                     tail[3] != 0, entry);
  }
  return out;
}

void set_layer_tuner(LayerTuner t) {
  std::lock_guard<std::mutex> lock(layers_mutex);
  tuner() = std::move(t);
}

TORCH_LIBRARY_FRAGMENT(convtune, m) {
  const std::string geometry = "int[] stride, int[] padding, int[] dilation, int groups, int layer";
  for (const std::string& schema :
       {"layer_conv(Tensor x, Tensor w, Tensor? bias, " + geometry + ", bool need_dx, bool need_dw) -> Tensor",
        "layer_run(Tensor x, Tensor w, " + geometry + ", bool need_dx, bool need_dw) -> Tensor",
        "layer_backward(Tensor dy, Tensor x, Tensor w, " + geometry + ") -> (Tensor, Tensor)",
        "layer_backward_data(Tensor dy, Tensor x, Tensor w, " + geometry + ") -> Tensor",
        "layer_backward_filter(Tensor dy, Tensor x, Tensor w, " + geometry + ") -> Tensor"}) {
    m.def(schema.c_str(), {at::Tag::pt2_compliant_tag});
  }
}

#define CONVTUNE_LAYER_KERNELS(KEY)                    \
  TORCH_LIBRARY_IMPL(convtune, KEY, m) {               \
    m.impl("layer_conv", &forward_below_autograd);     \
    m.impl("layer_run", &run_layer);                   \
    m.impl("layer_backward", &run_backward_both);      \
    m.impl("layer_backward_data", &run_backward<true>);    \
    m.impl("layer_backward_filter", &run_backward<false>); \
  }
CONVTUNE_LAYER_KERNELS(CPU)
CONVTUNE_LAYER_KERNELS(CUDA)

TORCH_LIBRARY_IMPL(convtune, Meta, m) {
  m.impl("layer_conv", &forward_below_autograd);
  m.impl("layer_run", &run_layer_meta);
  m.impl("layer_backward", &backward_both_meta);
  m.impl("layer_backward_data", &backward_meta<true>);
  m.impl("layer_backward_filter", &backward_meta<false>);
}

TORCH_LIBRARY_IMPL(convtune, Autograd, m) {
  m.impl("layer_conv", &conv_autograd);
  m.impl("layer_run", &run_autograd);
  m.impl("layer_backward", &backward_both_autograd);
  m.impl("layer_backward_data", &backward_autograd<true>);
  m.impl("layer_backward_filter", &backward_autograd<false>);
}

TORCH_LIBRARY_IMPL(convtune, AutocastCPU, m) { m.impl("layer_conv", &conv_autocast<c10::DeviceType::CPU>); }

TORCH_LIBRARY_IMPL(convtune, AutocastCUDA, m) { m.impl("layer_conv", &conv_autocast<c10::DeviceType::CUDA>); }

}  // namespace convtune
