// Test support (see grouped_matmul.h, grouped_matmul_replays_equal): the grouped GEMM launchers
// captured into a CUDA graph, as XLA's command buffers capture kCmdBufferCompatible handlers, and
// the graph's replays compared byte for byte with a direct launch. Buffers are allocated here,
// outside any capture; the sizes cover a full and a partial M tile, an empty group and a slot.
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "kernels/constants.h"
#include "kernels/grouped_matmul.h"

namespace moonep {
namespace {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }

  // `bytes` of `host` (or of 0xff bytes when `host` is null, a poison no result keeps).
  cudaError_t fill(size_t bytes, const void* host) {
    bytes_ = bytes;
    if (cudaError_t e = cudaMalloc(&ptr_, bytes); e != cudaSuccess) return e;
    if (host == nullptr) return cudaMemset(ptr_, 0xff, bytes);
    return cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Random bf16 values in [-1, 1) (their bit patterns; truncation is fine for test data).
std::vector<uint16_t> random_bf16(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<uint16_t> v(n);
  for (auto& x : v) {
    const float f = dist(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    x = static_cast<uint16_t>(bits >> 16);
  }
  return v;
}

using Launch = std::function<cudaError_t(cudaStream_t)>;

cudaError_t read_back(const std::vector<const DeviceBuffer*>& outs, cudaStream_t stream,
                      std::vector<std::vector<char>>* host) {
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) return e;
  host->resize(outs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    (*host)[i].resize(outs[i]->bytes());
    if (cudaError_t e = cudaMemcpy((*host)[i].data(), outs[i]->as<char>(), outs[i]->bytes(),
                                   cudaMemcpyDeviceToHost);
        e != cudaSuccess)
      return e;
  }
  return cudaSuccess;
}

// Runs `launch` directly, then captured (thread-local mode, as XLA traces command buffers) and
// replayed twice, each replay after poisoning the outputs; *equal: both replays wrote exactly the
// direct launch's bytes.
cudaError_t direct_vs_replays(const Launch& launch, const std::vector<const DeviceBuffer*>& outs,
                              bool* equal) {
  *equal = false;
  cudaStream_t stream;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess)
    return e;
  std::vector<std::vector<char>> direct, replayed;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaError_t err = launch(stream);
  if (err == cudaSuccess) err = read_back(outs, stream, &direct);
  if (err == cudaSuccess) err = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
  if (err == cudaSuccess) {
    const cudaError_t launched = launch(stream);
    err = cudaStreamEndCapture(stream, &graph);
    if (launched != cudaSuccess) err = launched;
  }
  if (err == cudaSuccess) err = cudaGraphInstantiate(&exec, graph, 0);
  *equal = err == cudaSuccess;
  for (int replay = 0; replay < 2 && err == cudaSuccess; ++replay) {
    for (const DeviceBuffer* out : outs)
      if (err == cudaSuccess) err = cudaMemsetAsync(out->as<char>(), 0xff, out->bytes(), stream);
    if (err == cudaSuccess) err = cudaGraphLaunch(exec, stream);
    if (err == cudaSuccess) err = read_back(outs, stream, &replayed);
    *equal = *equal && err == cudaSuccess && replayed == direct;
  }
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  return err;
}

}  // namespace

cudaError_t grouped_matmul_replays_equal(bool* forward, bool* dx, bool* dw) {
  constexpr int32_t kRows = 640, kD0 = 256, kD1 = 512, kLocal = 3, kSlots = 2;
  // Groups: 200 rows, an empty one, 141, then slot 0 with 159 rows and slot 1 with 100; the last
  // 40 rows belong to no group.
  const std::vector<int32_t> cu_seqlens = {200, 200, 341, 500, 600};
  const std::vector<int32_t> ep_rank = {0}, experts_to_copy = {1, -1};
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  std::mt19937 rng(20261201);
  const auto bf16 = [&](DeviceBuffer& b, size_t n) {
    const std::vector<uint16_t> v = random_bf16(n, rng);
    return b.fill(n * sizeof(uint16_t), v.data());
  };
  DeviceBuffer x, dy, w_local, w_slots, cu, rank, copies, y, dx_out, table, dw_local, dw_slots,
      flags, schedule;
  const size_t mats = static_cast<size_t>(kD0) * kD1;
  const size_t table_bytes =
      static_cast<size_t>(grouped_matmul_table_rows(kRows, kLocal + kSlots, false)) * kTableColumns *
      sizeof(int32_t);
  for (cudaError_t e :
       {bf16(x, size_t{kRows} * kD0), bf16(dy, size_t{kRows} * kD1), bf16(w_local, kLocal * mats),
        bf16(w_slots, kSlots * mats), cu.fill(cu_seqlens.size() * 4, cu_seqlens.data()),
        rank.fill(4, ep_rank.data()),
        copies.fill(experts_to_copy.size() * 4, experts_to_copy.data()),
        y.fill(size_t{kRows} * kD1 * 2, nullptr), dx_out.fill(size_t{kRows} * kD0 * 2, nullptr),
        table.fill(table_bytes, nullptr), dw_local.fill(kLocal * mats * 2, nullptr),
        dw_slots.fill(kSlots * mats * 4, nullptr), flags.fill(kLocal * 4, nullptr),
        schedule.fill((kDwScheduleSlots + kSlots) * 4, nullptr)}) {
    if (e != cudaSuccess) return e;
  }
  const auto rows_params = [&](GroupedMatmulOp op, const DeviceBuffer& in,
                               const DeviceBuffer& out) {
    GroupedMatmulParams p{};
    p.op = op;
    p.device = device;
    p.in = in.as<void>();
    p.w_local = w_local.as<void>();
    p.w_slots = w_slots.as<void>();
    p.out = out.as<void>();
    p.cu_seqlens = cu.as<int32_t>();
    p.ep_rank = rank.as<int32_t>();
    p.tile_table = table.as<int32_t>();
    p.num_rows = kRows;
    p.d0 = kD0;
    p.d1 = kD1;
    p.num_local = kLocal;
    p.num_slots = kSlots;
    p.num_groups = kLocal + kSlots;
    return p;
  };
  const GroupedMatmulParams fwd_params = rows_params(GroupedMatmulOp::kForward, x, y);
  const GroupedMatmulParams dx_params = rows_params(GroupedMatmulOp::kDx, dy, dx_out);
  GroupedMatmulDwParams dw_params{};
  dw_params.device = device;
  dw_params.x = x.as<void>();
  dw_params.dy = dy.as<void>();
  dw_params.dw_local = dw_local.as<void>();
  dw_params.dw_slots = dw_slots.as<float>();
  dw_params.replica_flags = flags.as<int32_t>();
  dw_params.schedule = schedule.as<int32_t>();
  dw_params.experts_to_copy = copies.as<int32_t>();
  dw_params.cu_seqlens = cu.as<int32_t>();
  dw_params.ep_rank = rank.as<int32_t>();
  dw_params.num_rows = kRows;
  dw_params.d0 = kD0;
  dw_params.d1 = kD1;
  dw_params.num_local = kLocal;
  dw_params.num_slots = kSlots;
  dw_params.num_copies = static_cast<int32_t>(experts_to_copy.size());
  dw_params.num_groups = kLocal + kSlots;
  dw_params.zero_unused_slots = true;
  if (cudaError_t e = direct_vs_replays(
          [&](cudaStream_t s) { return launch_grouped_matmul(fwd_params, s); }, {&y}, forward);
      e != cudaSuccess)
    return e;
  if (cudaError_t e = direct_vs_replays(
          [&](cudaStream_t s) { return launch_grouped_matmul(dx_params, s); }, {&dx_out}, dx);
      e != cudaSuccess)
    return e;
  return direct_vs_replays([&](cudaStream_t s) { return launch_grouped_matmul_dw(dw_params, s); },
                           {&dw_local, &dw_slots}, dw);
}

}  // namespace moonep
