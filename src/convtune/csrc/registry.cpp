// The registry of executables and the checks every run makes.
#include "executable.h"

#include <c10/util/Exception.h>
#include <pthread.h>

#include <atomic>
#include <limits>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <unordered_map>

namespace convtune {

namespace {

struct Entry {
  std::string description;
  ExecutablePtr executable;
};

std::shared_mutex registry_mutex;
std::unordered_map<int64_t, Entry>& registry() {
  static auto* entries = new std::unordered_map<int64_t, Entry>();  // never freed: ops may run at exit
  return *entries;
}

// A child forked while another thread held the lock (a DataLoader forks its workers while the background worker adds
// an executable, or an autograd thread looks one up) would find it held for ever: fork takes it first (so the table
// is whole), the parent releases it after, and the child, whose thread is not the one that took it (a lock held for
// writing is released by its own thread only), starts with a new one.
void lock_for_fork() { registry_mutex.lock(); }
void unlock_after_fork() { registry_mutex.unlock(); }
void renew_after_fork() { new (&registry_mutex) std::shared_mutex(); }
const int registry_fork_handlers = pthread_atfork(lock_for_fork, unlock_after_fork, renew_after_fork);

constexpr int64_t kAlignBytes = 256;

int64_t aligned(int64_t nbytes) { return (nbytes + kAlignBytes - 1) / kAlignBytes * kAlignBytes; }

int64_t buffer_nbytes(const BufferSpec& b) {
  int64_t n = c10::elementSize(b.dtype);
  for (auto s : b.shape) n *= s;
  return n;
}

}  // namespace

std::string text(int64_t value) { return std::to_string(value); }

std::string text(at::IntArrayRef values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

const char* operand_name(Direction d, int index) {
  static const char* names[3][3] = {{"x", "w", "y"}, {"dy", "w", "dx"}, {"x", "dy", "dw"}};
  return names[static_cast<int>(d)][index];
}

void add_executable(int64_t handle, const std::string& description, ExecutablePtr executable) {
  std::unique_lock<std::shared_mutex> lock(registry_mutex);
  auto& entries = registry();
  auto found = entries.find(handle);
  if (found != entries.end()) {
    TORCH_CHECK_VALUE(found->second.description == description, "convtune: executable handle ", text(handle),
                      " is already taken by '", found->second.description, "', not '", description,
                      "'; handles must be derived from the whole description (convtune.pytorch.runtime.handle_of)");
    return;
  }
  entries.emplace(handle, Entry{description, std::move(executable)});
}

bool has_executable(int64_t handle) {
  std::shared_lock<std::shared_mutex> lock(registry_mutex);
  return registry().count(handle) != 0;
}

ExecutablePtr find_executable(int64_t handle) {
  {
    std::shared_lock<std::shared_mutex> lock(registry_mutex);
    auto& entries = registry();
    auto found = entries.find(handle);
    if (found != entries.end()) return found->second.executable;
  }
  TORCH_CHECK_VALUE(false, "convtune: no executable has handle ", text(handle),
                    " in this process; tune the layer here (convtune.optimize or a convtune.nn module's first call) "
                    "before running it, or rebuild the compiled model in this process");
}

int64_t executable_count() {
  std::shared_lock<std::shared_mutex> lock(registry_mutex);
  return static_cast<int64_t>(registry().size());
}

bool fits(const at::Tensor& t, const Spec& spec) {
  auto sizes = t.sizes();
  if (sizes.size() != spec.shape.size()) return false;
  auto strides = t.strides();
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] != spec.shape[i]) return false;
    if (sizes[i] != 1 && strides[i] != spec.strides[i]) return false;
  }
  return true;
}

at::Tensor laid_out(const at::Tensor& t, const Spec& spec) {
  if (fits(t, spec)) return t;
  return at::empty_strided(spec.shape, spec.strides, t.options()).copy_(t);
}

at::Tensor gradient_for_both(const at::Tensor& dy, int64_t data, int64_t filter) {
  const ExecutablePtr data_exe = find_executable(data), filter_exe = find_executable(filter);
  const Spec& a = data_exe->geometry.a;
  const Spec& b = filter_exe->geometry.b;
  if (a.shape != b.shape || a.strides != b.strides || !dy.sizes().equals(a.shape)) return dy;
  return laid_out(dy, a);
}

std::vector<int64_t> dense_strides(const std::vector<int64_t>& shape, bool channels_last) {
  const size_t nd = shape.size();
  std::vector<size_t> order(nd);  // outermost first
  for (size_t i = 0; i < nd; ++i) order[i] = i;
  if (channels_last && nd > 2) {
    order.clear();
    order.push_back(0);
    for (size_t i = 2; i < nd; ++i) order.push_back(i);
    order.push_back(1);
  }
  std::vector<int64_t> strides(nd);
  int64_t step = 1;
  for (size_t i = nd; i-- > 0;) {
    strides[order[i]] = step;
    step *= std::max<int64_t>(shape[order[i]], 1);
  }
  return strides;
}

int64_t buffers_bytes(const std::vector<BufferSpec>& buffers) {
  int64_t total = 0;
  for (const auto& b : buffers) total += aligned(buffer_nbytes(b));
  return total;
}

std::map<std::string, at::Tensor> carve(const at::Tensor& workspace, const std::vector<BufferSpec>& buffers) {
  std::map<std::string, at::Tensor> views;
  int64_t offset = 0;
  for (const auto& b : buffers) {
    const int64_t nbytes = buffer_nbytes(b);
    if (nbytes == 0) {
      views[b.name] = at::empty(b.shape, workspace.options().dtype(b.dtype));
      continue;
    }
    views[b.name] = workspace.narrow(0, offset, nbytes).view(b.dtype).view(b.shape);
    offset += aligned(nbytes);
  }
  return views;
}

void Executable::check(const at::Tensor& a, const at::Tensor& b, bool device, bool strides) const {
  const Geometry& g = geometry;
  const at::Tensor* operands[2] = {&a, &b};
  const Spec* specs[2] = {&g.a, &g.b};
  for (int i = 0; i < 2; ++i) {
    const at::Tensor& t = *operands[i];
    const Spec& spec = *specs[i];
    const char* name = operand_name(g.direction, i);
    TORCH_CHECK_VALUE(t.defined(), g.label, ": operand ", name, " is undefined");
    // Both operands on the problem's device type, and the second on the first's device (a GPU index too).
    const bool on_device = !device || (t.device().type() == g.device_type && (i == 0 || t.device() == a.device()));
    if (t.scalar_type() == g.dtype && on_device && (strides ? fits(t, spec) : t.sizes() == at::IntArrayRef(spec.shape)))
      continue;
    TORCH_CHECK_VALUE(t.scalar_type() == g.dtype, g.label, ": operand ", name, " has dtype ",
                      c10::toString(t.scalar_type()), ", the tuned problem needs ", c10::toString(g.dtype));
    TORCH_CHECK_VALUE(on_device, g.label, ": operand ", name, " is on ", t.device(), ", the tuned problem is on ",
                      g.device_type, i == 0 ? "" : " (the same device as the first operand)");
    TORCH_CHECK_VALUE(t.sizes() == at::IntArrayRef(spec.shape), g.label, ": operand ", name, " has shape ",
                      text(t.sizes()), ", the tuned problem needs ", text(spec.shape));
    TORCH_CHECK_VALUE(false, g.label, ": operand ", name, " has strides ", text(t.strides()), ", not dense in the ",
                      g.channels_last ? "channels_last" : "channels_first",
                      " layout the problem was tuned for (strides ", text(spec.strides),
                      "); convert it with convtune.to_layout");
  }
}

void Executable::check_input(const at::Tensor& x) const {
  const Spec& spec = geometry.a;
  TORCH_CHECK_VALUE(fits(x, spec), geometry.label, ": input x of shape ", text(x.sizes()), " and strides ", text(x.strides()),
                    " is not the tuned problem's (shape ", text(spec.shape), ", dense in the ",
                    geometry.channels_last ? "channels_last" : "channels_first", " layout, strides ",
                    text(spec.strides), ")");
}

namespace {
std::atomic<bool> poison_results{false};
}

void set_poison(bool on) { poison_results.store(on); }

at::Tensor Executable::empty_result(const at::Tensor& like) const {
  at::Tensor out = at::empty_strided(geometry.out.shape, geometry.out.strides, like.options());
  if (poison_results.load(std::memory_order_relaxed)) out.fill_(std::numeric_limits<double>::quiet_NaN());
  return out;
}

}  // namespace convtune
