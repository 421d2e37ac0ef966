// Layers: a tuned module's executables for every input signature it has met, looked up per call, so that
// compiled code runs a tuned layer whatever shape its input has (layers.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace convtune {

// What one signature runs: per direction (fwd, bwd_data, bwd_filter) the executable's handle, 0 for
// PyTorch's own call; ``tuned`` says which directions were selected for at all (one not selected yet
// asks the tuner when a call needs it).
struct LayerEntry {
  int64_t handles[3] = {0, 0, 0};
  bool tuned[3] = {false, false, false};
};

// A new layer of this geometry and weight shape (its id, never 0), and dropping one (its table goes with it).
int64_t layer_new(std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation,
                  int64_t groups, std::vector<int64_t> weight_shape);
void layer_drop(int64_t id);
// The table's entry for a signature: set (replacing any), forget, and every entry (for explain and tests).
void layer_set(int64_t id, const std::vector<int64_t>& shape, at::ScalarType dtype, at::Device device,
               bool channels_last, const LayerEntry& entry);
void layer_forget(int64_t id, const std::vector<int64_t>& shape, at::ScalarType dtype, at::Device device,
                  bool channels_last);
std::vector<std::tuple<std::vector<int64_t>, at::ScalarType, at::Device, bool, LayerEntry>> layer_entries(int64_t id);

// The control plane's answer for a signature the table lacks: it selects for the layer's input ``x``
// (the gradients ``need_dx``, ``need_dw`` included) and fills ``entry``; false where it cannot now (a
// CUDA graph being captured, the module gone), and the call then runs PyTorch's convolution.
using LayerTuner = std::function<bool(int64_t id, const at::Tensor& x, const at::Tensor& w, bool need_dx,
                                      bool need_dw, LayerEntry* entry)>;
void set_layer_tuner(LayerTuner tuner);

// torch.ops.convtune.tuned_run and tuned_conv through the dispatcher (ops.cpp).
at::Tensor run_tuned(const at::Tensor& a, const at::Tensor& b, int64_t handle);
at::Tensor conv_tuned(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t fwd,
                      int64_t bwd_data, int64_t bwd_filter);
// Whether an operand carries a forward-mode tangent (torch.autograd.forward_ad), which tuned_conv has no derivative for.
bool has_tangent(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);
// Whether a torch.func transform (grad, vjp, vmap, jacrev, jvp) is active on this thread: its tensors are wrappers
// that no executable runs on, and the ops' autograd Functions do not work under it; PyTorch's convolution does.
bool under_transform();
// PyTorch's convolution, the op torch.nn's forward calls (aten::conv1d/2d/3d: autocast's lists name these).
at::Tensor torch_convolution(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                             at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups);
struct Geometry;
// The same with an executable's stride, padding, dilation and groups (executable.h).
at::Tensor torch_convolution(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                             const Geometry& g);

}  // namespace convtune
