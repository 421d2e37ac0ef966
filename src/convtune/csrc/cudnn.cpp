// A cuDNN execution plan as an executable: exactly the engine and knob choices that find measured,
// rebuilt through cuDNN's backend API (the C API the cuDNN frontend itself calls, so nothing here
// clashes with PyTorch's own copy of the frontend). The plan is known by its tag, the name the
// frontend gives it ("eng<id>_k<knob>=<value>..."): the same operation graph is built here, cuDNN's
// heuristics list its configurations, and the one with that tag is built. Compiled only where
// cuDNN's headers are found (CONVTUNE_WITH_CUDNN); elsewhere make_cudnn raises.
#include "executable.h"

#ifdef CONVTUNE_WITH_CUDNN

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cudnn.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace convtune {

namespace {

#define CONVTUNE_CUDNN(label, what, expr)                                                                     \
  do {                                                                                                        \
    cudnnStatus_t status_ = (expr);                                                                           \
    TORCH_CHECK(status_ == CUDNN_STATUS_SUCCESS, label, ": cuDNN ", what, " failed: ", cudnnGetErrorString(status_)); \
  } while (0)

// One backend descriptor, destroyed with its owner.
class Descriptor {
 public:
  Descriptor(cudnnBackendDescriptorType_t type, const std::string& label) {
    CONVTUNE_CUDNN(label, "descriptor creation", cudnnBackendCreateDescriptor(type, &raw_));
  }
  ~Descriptor() {
    if (raw_) cudnnBackendDestroyDescriptor(raw_);
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  cudnnBackendDescriptor_t get() const { return raw_; }
  cudnnBackendDescriptor_t* address() { return &raw_; }

 private:
  cudnnBackendDescriptor_t raw_ = nullptr;
};

// The cuDNN handle of this thread on a device (never destroyed: the process may end before the driver).
cudnnHandle_t thread_handle(int64_t device_index) {
  thread_local std::unordered_map<int64_t, cudnnHandle_t> handles;
  auto found = handles.find(device_index);
  if (found != handles.end()) return found->second;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  cudnnHandle_t handle = nullptr;
  CONVTUNE_CUDNN("convtune", "handle creation", cudnnCreate(&handle));
  handles.emplace(device_index, handle);
  return handle;
}

cudnnDataType_t data_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return CUDNN_DATA_FLOAT;
    case at::kHalf: return CUDNN_DATA_HALF;
    case at::kBFloat16: return CUDNN_DATA_BFLOAT16;
    default: TORCH_CHECK_VALUE(false, "convtune: cuDNN plans take float32, float16 or bfloat16, not ", c10::toString(t));
  }
}

class CudnnPlan final : public Executable {
 public:
  CudnnPlan(Geometry g, CudnnSpec spec, const std::string& serialized)
      : Executable(std::move(g)), spec_(std::move(spec)) {
    try {
      if (serialized.empty()) {
        build();
      } else {
        load(serialized);
      }
    } catch (...) {
      release();
      throw;
    }
  }
  ~CudnnPlan() override { release(); }
  const char* kind() const override { return "cudnn"; }

  std::string serialized() const override {
    int64_t size = 0;
    CONVTUNE_CUDNN(geometry.label, "plan serialization",
                   cudnnBackendGetAttribute(plan_->get(), CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
                                            0, &size, nullptr));
    std::string text(static_cast<size_t>(size), '\0');
    CONVTUNE_CUDNN(geometry.label, "plan serialization",
                   cudnnBackendGetAttribute(plan_->get(), CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
                                            size, &size, text.data()));
    return text;
  }
  int64_t workspace_bytes() const override { return workspace_bytes_; }

  at::Tensor run(const at::Tensor& a_in, const at::Tensor& b_in) const override {
    const std::string& label = geometry.label;
    // The plan assumes operands aligned to kAlignment bytes: a view that starts elsewhere (x[1:]) is copied, as
    // torch's convolution takes it.
    const at::Tensor a = aligned(a_in), b = aligned(b_in);
    const int64_t device = a.device().index();  // another GPU than the build's gets the plan from its serialized form
    at::Tensor out = empty_result(a);
    at::Tensor workspace;
    if (workspace_bytes_) workspace = at::empty({workspace_bytes_}, a.options().dtype(at::kByte));
    void* pointers[3] = {a.data_ptr(), b.data_ptr(), out.data_ptr()};
    cudnnHandle_t handle = thread_handle(device);
    CONVTUNE_CUDNN(label, "set stream",
                   cudnnSetStream(handle, c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream()));
    Descriptor pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, label);
    void* ws = workspace_bytes_ ? workspace.data_ptr() : nullptr;
    CONVTUNE_CUDNN(label, "variant pack", cudnnBackendSetAttribute(pack.get(), CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
                                                                  CUDNN_TYPE_INT64, 3, kUids));
    CONVTUNE_CUDNN(label, "variant pack", cudnnBackendSetAttribute(pack.get(), CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
                                                                  CUDNN_TYPE_VOID_PTR, 3, pointers));
    CONVTUNE_CUDNN(label, "variant pack", cudnnBackendSetAttribute(pack.get(), CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
                                                                  CUDNN_TYPE_VOID_PTR, 1, &ws));
    CONVTUNE_CUDNN(label, "variant pack", cudnnBackendFinalize(pack.get()));
    CONVTUNE_CUDNN(label, "execute", cudnnBackendExecute(handle, plan_for(handle), pack.get()));
    return out;
  }

 private:
  static constexpr int64_t kAlignment = 16;  // what the frontend's tensors declare, and so the tuned plans assume

  static at::Tensor aligned(const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % kAlignment == 0 ? t : t.clone(at::MemoryFormat::Preserve);
  }
  static constexpr int64_t kUids[3] = {1, 2, 3};  // a, b, result

  // The plan made with ``handle``: a plan belongs to the handle it was finalized with, and each thread
  // and device runs with its own handle (the autograd engine runs backward passes on threads of its
  // own), so each other handle gets the plan again from its serialized form (no heuristics, well
  // under a ms; a GPU of another architecture refuses it, and the error says so).
  cudnnBackendDescriptor_t plan_for(cudnnHandle_t handle) const {
    if (handle == build_handle_) return plan_->get();
    std::lock_guard<std::mutex> lock(per_handle_mutex_);
    auto found = per_handle_.find(handle);
    if (found != per_handle_.end()) return found->second->get();
    if (serialized_.empty()) serialized_ = serialized();
    auto plan = std::make_unique<Descriptor>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, geometry.label);
    CONVTUNE_CUDNN(geometry.label, "plan for another thread",
                   cudnnBackendSetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
                                            static_cast<int64_t>(serialized_.size()), serialized_.data()));
    CONVTUNE_CUDNN(geometry.label, "plan for another thread",
                   cudnnBackendSetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle));
    CONVTUNE_CUDNN(geometry.label, "plan for another thread", cudnnBackendFinalize(plan->get()));
    cudnnBackendDescriptor_t raw = plan->get();
    per_handle_.emplace(handle, std::move(plan));
    return raw;
  }

  // Descriptors go in the reverse order of their making: a plan before its configuration, its engine, its graph.
  void release() {
    per_handle_.clear();
    while (!keep_.empty()) keep_.pop_back();
  }

  Descriptor& make(cudnnBackendDescriptorType_t type) {
    keep_.push_back(std::make_unique<Descriptor>(type, geometry.label));
    return *keep_.back();
  }

  void set(Descriptor& d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
           const void* value) {
    CONVTUNE_CUDNN(geometry.label, "attribute", cudnnBackendSetAttribute(d.get(), name, type, count, value));
  }

  void finalize(Descriptor& d, const char* what) {
    CONVTUNE_CUDNN(geometry.label, what, cudnnBackendFinalize(d.get()));
  }

  cudnnBackendDescriptor_t tensor(int64_t uid, const Spec& spec) {
    Descriptor& d = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    cudnnDataType_t type = data_type(geometry.dtype);
    set(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    set(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, spec.shape.size(), spec.shape.data());
    set(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, spec.strides.size(), spec.strides.data());
    set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    set(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &kAlignment);
    finalize(d, "tensor descriptor");
    return d.get();
  }

  void build() {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(spec_.device_index));
    cudnnHandle_t handle = thread_handle(spec_.device_index);
    const Direction dir = geometry.direction;
    // uids: a = 1, b = 2, result = 3, whatever each is called in the direction.
    const Spec* x = &spec_.x;
    const Spec* w = &spec_.w;
    const Spec* y = &spec_.y;
    cudnnBackendDescriptor_t tx, tw, ty;
    if (dir == Direction::Fwd) {
      tx = tensor(1, *x), tw = tensor(2, *w), ty = tensor(3, *y);
    } else if (dir == Direction::BwdData) {
      ty = tensor(1, *y), tw = tensor(2, *w), tx = tensor(3, *x);
    } else {
      tx = tensor(1, *x), ty = tensor(2, *y), tw = tensor(3, *w);
    }
    Descriptor& conv = make(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
    cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
    int64_t dims = static_cast<int64_t>(spec_.stride.size());
    set(conv, CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute);
    set(conv, CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode);
    set(conv, CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &dims);
    set(conv, CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, dims, spec_.dilation.data());
    set(conv, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, dims, spec_.stride.data());
    set(conv, CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, dims, spec_.padding.data());
    set(conv, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, dims, spec_.padding.data());
    finalize(conv, "convolution descriptor");
    cudnnBackendDescriptor_t conv_desc = conv.get();
    // The operation of the direction, its operands by role: (x, w, y) attributes of each kind.
    struct Attributes {
      cudnnBackendDescriptorType_t type;
      cudnnBackendAttributeName_t x, w, y, conv, alpha, beta;
    };
    static const Attributes attributes[3] = {
        {CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
         CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
         CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
         CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA},
        {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA},
        {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
         CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA},
    };
    const Attributes& role = attributes[static_cast<int>(dir)];
    float alpha = 1.0f, beta = 0.0f;
    Descriptor* op = &make(role.type);
    set(*op, role.x, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &tx);
    set(*op, role.w, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &tw);
    set(*op, role.y, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &ty);
    set(*op, role.conv, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &conv_desc);
    set(*op, role.alpha, CUDNN_TYPE_FLOAT, 1, &alpha);
    set(*op, role.beta, CUDNN_TYPE_FLOAT, 1, &beta);
    finalize(*op, "operation descriptor");
    cudnnBackendDescriptor_t op_desc = op->get();
    Descriptor& graph = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &op_desc);
    set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    finalize(graph, "operation graph");
    cudnnBackendDescriptor_t graph_desc = graph.get();
    cudnnBackendDescriptor_t config_desc = find_config(graph.get());
    plan_ = &make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    set(*plan_, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    set(*plan_, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &config_desc);
    finalize(*plan_, "execution plan");
    build_handle_ = handle;
    read_workspace_size();
  }

  // The plan from its serialized form: no operation graph, no heuristics.
  void load(const std::string& serialized) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(spec_.device_index));
    cudnnHandle_t handle = thread_handle(spec_.device_index);
    plan_ = &make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    set(*plan_, CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, CUDNN_TYPE_CHAR, static_cast<int64_t>(serialized.size()),
        serialized.data());
    set(*plan_, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    finalize(*plan_, "execution plan from its serialized form (another cuDNN or GPU?)");
    build_handle_ = handle;
    read_workspace_size();
  }

  void read_workspace_size() {
    int64_t count = 0;
    CONVTUNE_CUDNN(geometry.label, "workspace size",
                   cudnnBackendGetAttribute(plan_->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                            &count, &workspace_bytes_));
  }

  // The engine configuration of cuDNN's heuristics (modes A, then FALLBACK, as find listed them) whose
  // tag is the tuned plan's: the same engine and every knob choice, the ones the frontend cannot name too.
  cudnnBackendDescriptor_t find_config(cudnnBackendDescriptor_t graph) {
    const std::string& label = geometry.label;
    for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      Descriptor& heuristics = make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
      set(heuristics, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph);
      set(heuristics, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
      if (cudnnBackendFinalize(heuristics.get()) != CUDNN_STATUS_SUCCESS) continue;
      int64_t count = 0;
      CONVTUNE_CUDNN(label, "heuristics", cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr));
      std::vector<cudnnBackendDescriptor_t> configs;
      for (int64_t i = 0; i < count; ++i) configs.push_back(make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR).get());
      CONVTUNE_CUDNN(label, "heuristics", cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &count,
                                                                  configs.data()));
      for (int64_t i = 0; i < count; ++i)
        if (tag_of(configs[i]) == spec_.tag) return configs[i];
    }
    TORCH_CHECK_VALUE(false, label, ": cuDNN's heuristics offer no plan ", spec_.tag,
                      " for this problem here (another cuDNN or GPU than the one it was tuned on?); tune it again");
  }

  // What the cuDNN frontend names a plan: "eng<global index>" and "_k<knob type>=<value>" by knob type.
  std::string tag_of(cudnnBackendDescriptor_t config) {
    const std::string& label = geometry.label;
    Descriptor engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR, label);
    int64_t count = 0, engine_id = -1;
    cudnnBackendDescriptor_t engine_desc = engine.get();
    CONVTUNE_CUDNN(label, "engine query", cudnnBackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_ENGINE,
                                                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &count, &engine_desc));
    CONVTUNE_CUDNN(label, "engine query", cudnnBackendGetAttribute(engine_desc, CUDNN_ATTR_ENGINE_GLOBAL_INDEX,
                                                                  CUDNN_TYPE_INT64, 1, &count, &engine_id));
    std::vector<std::unique_ptr<Descriptor>> knobs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int i = 0; i < CUDNN_KNOB_TYPE_COUNTS; ++i) {
      knobs.push_back(std::make_unique<Descriptor>(CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR, label));
      raw.push_back(knobs.back()->get());
    }
    CONVTUNE_CUDNN(label, "knob query", cudnnBackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES,
                                                                CUDNN_TYPE_BACKEND_DESCRIPTOR, CUDNN_KNOB_TYPE_COUNTS,
                                                                &count, raw.data()));
    std::vector<std::pair<int64_t, int64_t>> choices;
    for (int64_t i = 0; i < count; ++i) {
      cudnnBackendKnobType_t type;
      int64_t value = 0;
      CONVTUNE_CUDNN(label, "knob query", cudnnBackendGetAttribute(raw[i], CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE,
                                                                  CUDNN_TYPE_KNOB_TYPE, 1, nullptr, &type));
      CONVTUNE_CUDNN(label, "knob query", cudnnBackendGetAttribute(raw[i], CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE,
                                                                  CUDNN_TYPE_INT64, 1, nullptr, &value));
      choices.emplace_back(static_cast<int64_t>(type), value);
    }
    std::sort(choices.begin(), choices.end());
    std::string tag = "eng" + std::to_string(engine_id);
    for (const auto& [type, value] : choices) tag += "_k" + std::to_string(type) + "=" + std::to_string(value);
    return tag;
  }

  const CudnnSpec spec_;
  std::vector<std::unique_ptr<Descriptor>> keep_;  // every descriptor the plan was made from
  Descriptor* plan_ = nullptr;
  cudnnHandle_t build_handle_ = nullptr;  // the handle plan_ was finalized with
  mutable std::mutex per_handle_mutex_;
  mutable std::unordered_map<cudnnHandle_t, std::unique_ptr<Descriptor>> per_handle_;  // plans of other threads
  mutable std::string serialized_;  // plan_'s serialized form, taken when a second handle first needs it
  int64_t workspace_bytes_ = 0;
};

}  // namespace

bool with_cudnn() { return true; }

ExecutablePtr make_cudnn(Geometry g, CudnnSpec spec, const std::string& serialized) {
  return std::make_shared<CudnnPlan>(std::move(g), std::move(spec), serialized);
}

}  // namespace convtune

#else  // no cuDNN headers where this was built

namespace convtune {

bool with_cudnn() { return false; }

ExecutablePtr make_cudnn(Geometry g, CudnnSpec spec, const std::string& serialized) {
  TORCH_CHECK_VALUE(false, g.label, ": this build of convtune's extension has no cuDNN (its headers were not "
                    "found when it was built); install nvidia-cudnn and rebuild (convtune native --rebuild)");
}

}  // namespace convtune

#endif
