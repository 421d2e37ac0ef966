// The executables that ATen computes: torch:native (PyTorch's own convolution) and the GEMM paths
// gemm:1x1 and gemm:1x1_strided (matrix products of views). Each mirrors its Python algorithm in
// src/convtune/algorithms/ (native.py, gemm.py) call for call, so a layer computes the same numbers
// on either path; the comments there say why each step is what it is.
#include "executable.h"

#include <ATen/Context.h>

#include <limits>

namespace convtune {

namespace {

// PyTorch's global switches, set for one run and restored after (the Python algorithms do the same).
class CudnnFlags {
 public:
  CudnnFlags(bool cuda, bool allow_tf32) {
    if (!cuda) return;
    auto& ctx = at::globalContext();
    bool tf32 = true;
    try {
      tf32 = ctx.allowTF32CuDNN();
    } catch (const c10::Error&) {
      // PyTorch's per-operation settings differ (torch.backends.cudnn.conv.fp32_precision unlike the RNNs'), so the
      // flag has no one value: the settings are left as the user set them (a problem described now has the
      // convolutions' own, tf32.conv_allowed)
      return;
    }
    if (ctx.userEnabledCuDNN() && tf32 == allow_tf32) return;
    changed_ = true;
    enabled_ = ctx.userEnabledCuDNN();
    tf32_ = tf32;
    ctx.setUserEnabledCuDNN(true);
    ctx.setAllowTF32CuDNN(allow_tf32);
  }
  ~CudnnFlags() {
    if (!changed_) return;
    auto& ctx = at::globalContext();
    ctx.setUserEnabledCuDNN(enabled_);
    ctx.setAllowTF32CuDNN(tf32_);
  }

 private:
  bool changed_ = false, enabled_ = true, tf32_ = true;
};

class MatmulTf32 {
 public:
  MatmulTf32(bool cuda, bool allowed) {
    if (!cuda) return;
    auto& ctx = at::globalContext();
    bool tf32 = false;
    try {
      tf32 = ctx.allowTF32CuBLAS();
    } catch (const c10::Error&) {
      // The flag disagrees with a precision set through PyTorch's newer interface
      // (torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision): left as the user set it, as in
      // CudnnFlags (the Python path switches the precision itself, tf32.matmul; this path cannot read it on every
      // PyTorch it builds against)
      return;
    }
    if (tf32 == allowed) return;
    changed_ = true;
    saved_ = tf32;
    precision_ = ctx.float32MatmulPrecision();
    ctx.setAllowTF32CuBLAS(allowed);
  }
  ~MatmulTf32() {
    if (!changed_) return;
    auto& ctx = at::globalContext();
    ctx.setAllowTF32CuBLAS(saved_);
    // The flag put back is 'high' where it allows TF32: a user's 'medium' (torch.set_float32_matmul_precision) is
    // put back by name, as tf32.matmul does.
    try {
      if (ctx.float32MatmulPrecision() != precision_) {
        ctx.setFloat32MatmulPrecision(precision_ == at::Float32MatmulPrecision::MEDIUM ? "medium"
                                      : precision_ == at::Float32MatmulPrecision::HIGH ? "high" : "highest");
      }
    } catch (const c10::Error&) {  // (a destructor throws nothing; the flag is back whatever happens here)
    }
  }

 private:
  bool changed_ = false, saved_ = false;
  at::Float32MatmulPrecision precision_ = at::Float32MatmulPrecision::HIGHEST;
};

// -- torch:native ----------------------------------------------------------------------------
class Native final : public Executable {
 public:
  using Executable::Executable;
  const char* kind() const override { return "native"; }

  at::Tensor run(const at::Tensor& a_in, const at::Tensor& b_in) const override {
    const Geometry& g = geometry;
    CudnnFlags flags(a_in.is_cuda(), g.allow_tf32);
    std::vector<int64_t> output_padding(g.stride.size(), 0);
    at::Tensor result;
    // PyTorch's CPU bfloat16 kernels are wrong in some cases (algorithms/native.py, _bfloat16_on_cpu):
    // computed in float32 (the operands' layouts kept), rounded once at the end.
    const bool upcast = a_in.device().is_cpu() && g.dtype == at::kBFloat16;
    const at::Tensor a = upcast ? a_in.to(at::kFloat) : a_in;
    const at::Tensor b = upcast ? b_in.to(at::kFloat) : b_in;
    if (g.direction == Direction::Fwd) {
      result = at::convolution(a, b, std::nullopt, g.stride, g.padding, g.dilation, false, output_padding, g.groups);
    } else if (g.direction == Direction::BwdData) {
      at::Tensor x = at::empty_strided(g.out.shape, g.out.strides, a.options());
      result = std::get<0>(at::convolution_backward(a, x, b, std::nullopt, g.stride, g.padding, g.dilation, false,
                                                    output_padding, g.groups, {true, false, false}));
    } else {
      at::Tensor w = at::empty_strided(g.out.shape, g.out.strides, a.options());
      result = std::get<1>(at::convolution_backward(b, a, w, std::nullopt, g.stride, g.padding, g.dilation, false,
                                                    output_padding, g.groups, {false, true, false}));
    }
    if (upcast) result = result.to(at::kBFloat16);
    return laid_out(result, g.out);
  }
};

// -- gemm:1x1 and gemm:1x1_strided -----------------------------------------------------------
// A channels_last (N, C, *spatial) tensor as the (G, N*spatial, C/G) batch of row matrices; a view.
at::Tensor rows_by_group(const at::Tensor& t, int64_t g) {
  const int64_t c = t.size(1);
  return t.as_strided({g, t.numel() / c, c / g}, {c / g, c, 1}, t.storage_offset());
}

// A channels_first (N, C, *spatial) tensor as the view (N, G, C/G, prod(spatial)).
at::Tensor per_sample(const at::Tensor& t, int64_t g) { return t.view({t.size(0), g, t.size(1) / g, -1}); }

at::Tensor by_group(const at::Tensor& w, int64_t g) { return w.view({g, w.size(0) / g, -1}); }

// The products written into views of the result (the out= forms want a named tensor).
void bmm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b) { at::bmm_out(out, a, b); }
void mm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b) { at::mm_out(out, a, b); }
void matmul_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b) { at::matmul_out(out, a, b); }

// A channels_last (N, C, *spatial) tensor as the (N*spatial, C) row matrix; a view.
at::Tensor rows(const at::Tensor& t) {
  const int64_t c = t.size(1);
  return t.as_strided({t.numel() / c, c}, {c, 1}, t.storage_offset());
}

void gemm_channels_last(Direction d, const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, int64_t g) {
  if (g == 1) {  // one matrix product: mm costs less host time than a batched product of one matrix
    if (d == Direction::Fwd) {
      mm_into(rows(out), rows(a), b.view({b.size(0), -1}).t());
    } else if (d == Direction::BwdData) {
      mm_into(rows(out), rows(a), b.view({b.size(0), -1}));
    } else {
      mm_into(out.view({out.size(0), -1}), rows(b).t(), rows(a));
    }
    return;
  }
  if (d == Direction::Fwd) {
    bmm_into(rows_by_group(out, g), rows_by_group(a, g), by_group(b, g).transpose(1, 2));
  } else if (d == Direction::BwdData) {
    bmm_into(rows_by_group(out, g), rows_by_group(a, g), by_group(b, g));
  } else {
    bmm_into(by_group(out, g), rows_by_group(b, g).transpose(1, 2), rows_by_group(a, g));
  }
}

void gemm_channels_first(Direction d, const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, int64_t g,
                         const std::map<std::string, at::Tensor>& ws) {
  if (d == Direction::BwdFilter) {  // dW = sum over samples of dy[n] @ x[n]^T, in float32 for half dtypes
    at::Tensor x = per_sample(a, g), dy = per_sample(b, g), target = by_group(out, g);
    auto sum32 = ws.find("sum32");
    const int64_t n = x.size(0);
    if (sum32 == ws.end()) {
      bmm_into(target, dy[0], x[0].transpose(1, 2));
      for (int64_t i = 1; i < n; ++i) target.baddbmm_(dy[i], x[i].transpose(1, 2));
      return;
    }
    const at::Tensor& partial = ws.at("partial");
    const at::Tensor& widened = ws.at("widened");
    for (int64_t i = 0; i < n; ++i) {
      bmm_into(partial, dy[i], x[i].transpose(1, 2));
      if (i == 0) {
        sum32->second.copy_(partial);
      } else {
        widened.copy_(partial);
        sum32->second.add_(widened);
      }
    }
    target.copy_(sum32->second);
    return;
  }
  at::Tensor w = by_group(b, g);
  if (d == Direction::BwdData) w = w.transpose(1, 2);
  at::Tensor src = per_sample(a, g), dst = per_sample(out, g);
  if (g == 1) {
    matmul_into(dst.select(1, 0), w[0], src.select(1, 0));
    return;
  }
  for (int64_t i = 0; i < src.size(0); ++i) bmm_into(dst[i], w, src[i]);
}

class Gemm1x1 final : public Executable {
 public:
  Gemm1x1(Geometry g, bool strided, std::vector<BufferSpec> buffers)
      : Executable(std::move(g)), strided_(strided), buffers_(std::move(buffers)),
        workspace_bytes_(buffers_bytes(buffers_)) {}
  const char* kind() const override { return strided_ ? "gemm_1x1_strided" : "gemm_1x1"; }
  int64_t workspace_bytes() const override { return workspace_bytes_; }

  at::Tensor run(const at::Tensor& a, const at::Tensor& b) const override {
    const Geometry& g = geometry;
    at::Tensor out = empty_result(a);
    std::map<std::string, at::Tensor> ws;
    if (workspace_bytes_) ws = carve(at::empty({workspace_bytes_}, a.options().dtype(at::kByte)), buffers_);
    // TF32 applies to float32 products only: a half-dtype problem leaves the process-wide switch alone.
    MatmulTf32 tf32(a.is_cuda() && g.dtype == at::kFloat, g.allow_tf32);
    if (!strided_) {
      compute(g.direction, a, b, out, ws);
      return out;
    }
    // The input's every stride-th position is the whole input of an unstrided 1x1 convolution.
    const at::Tensor& raw = ws.at("slice");
    const Spec& x_spec = g.direction == Direction::BwdData ? g.out : g.a;
    std::vector<int64_t> sliced{x_spec.shape[0], x_spec.shape[1]};
    const Spec& y_spec = g.direction == Direction::Fwd ? g.out : (g.direction == Direction::BwdData ? g.a : g.b);
    for (size_t i = 2; i < y_spec.shape.size(); ++i) sliced.push_back(y_spec.shape[i]);
    at::Tensor xs = raw.as_strided(sliced, dense_strides(sliced, g.channels_last), raw.storage_offset());
    if (g.direction == Direction::BwdData) {
      compute(g.direction, a, b, xs, ws);
      out.zero_();
      every(out).copy_(xs);
      return out;
    }
    xs.copy_(every(a));
    compute(g.direction, xs, b, out, ws);
    return out;
  }

 private:
  void compute(Direction d, const at::Tensor& a, const at::Tensor& b, const at::Tensor& out,
               const std::map<std::string, at::Tensor>& ws) const {
    if (geometry.channels_last) {
      gemm_channels_last(d, a, b, out, geometry.groups);
    } else {
      gemm_channels_first(d, a, b, out, geometry.groups, ws);
    }
  }

  at::Tensor every(const at::Tensor& t) const {
    at::Tensor view = t;
    for (size_t i = 0; i < geometry.stride.size(); ++i)
      view = view.slice(static_cast<int64_t>(i) + 2, 0, std::numeric_limits<int64_t>::max(), geometry.stride[i]);
    return view;
  }

  const bool strided_;
  const std::vector<BufferSpec> buffers_;
  const int64_t workspace_bytes_;
};

}  // namespace

ExecutablePtr make_native(Geometry g) { return std::make_shared<Native>(std::move(g)); }

ExecutablePtr make_gemm_1x1(Geometry g, bool strided, std::vector<BufferSpec> buffers) {
  return std::make_shared<Gemm1x1>(std::move(g), strided, std::move(buffers));
}

}  // namespace convtune
