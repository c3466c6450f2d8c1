#include "kernels/prefetch.h"

#include "kernels/rendezvous.h"

namespace moonep {
namespace {

constexpr int kThreads = 512;
constexpr int kWarpSize = 32;
// Vector copies: vectors per thread loaded before the first store (several loads in flight).
constexpr int kUnroll = 4;
// Bulk copies: thread 0 of every CTA streams the CTA's share of the experts through kStages
// shared-memory stages of kStageBytes (TMA load into a stage, TMA store out of it), so that
// kStages - 1 loads stay in flight while a stage is stored.
constexpr int kStageBytes = 32 * 1024;
constexpr int kStages = 4;
constexpr int kStagesBytes = kStages * kStageBytes;  // dynamic shared memory of the copy kernel
// cp.async.bulk moves multiples of 16 bytes between 16-byte aligned addresses.
constexpr int64_t kBulkAlign = 16;
// Slots of one prefetch, held in shared memory: B <= epn <= E.
constexpr int kMaxSlots = kMaxExperts;

// ---- cp.async.bulk (TMA without a tensor map) and its mbarriers, sm_90 ----------------------

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
}

// Makes the initialised mbarriers visible to the async proxy that completes them.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Orders this thread's view of shared memory before its later bulk copies (async proxy).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// global -> shared::cta; `bar`'s current phase completes when all `bytes` have arrived.
__device__ __forceinline__ void bulk_load(void* stage, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               ::"r"(shared_address(bar)), "r"(bytes) : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(shared_address(stage)), "l"(src), "r"(bytes), "r"(shared_address(bar)) : "memory");
}

__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n"
      "}\n" ::"r"(shared_address(bar)), "r"(parity) : "memory");
}

// shared::cta -> global, as one bulk group.
__device__ __forceinline__ void bulk_store(void* dst, const void* stage, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
               ::"l"(dst), "r"(shared_address(stage)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Until at most `kPending` bulk groups still read shared memory (their stages may be refilled).
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Until every bulk group has completed its global writes.
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// ---- what to copy ------------------------------------------------------------------------------

// Per CTA, in shared memory: this rank's slot experts and every home rank's published w_local.
struct Tables {
  int32_t slot_expert[kMaxSlots];                          // -1: unused or bad plan data
  const char* home_w_local[kMaxPrefetchWeights][kMaxRanks];
};

__device__ void load_tables(const PrefetchParams& p, Tables& t) {
  const int num_experts = p.group.num_ranks * p.experts_per_rank;
  for (int b = threadIdx.x; b < p.num_slots; b += blockDim.x) {
    int32_t expert = p.experts_to_copy[p.group.rank * p.num_slots + b];
    if (expert < -1 || expert >= num_experts) {
      report_bad_plan_data(p.group, kOpPrefetch, expert,
                           "plan.experts_to_copy names an expert outside [-1, E)");
      expert = -1;
    }
    t.slot_expert[b] = expert;
  }
  for (int i = threadIdx.x; i < p.num_weights * p.group.num_ranks; i += blockDim.x) {
    const int w = i / p.group.num_ranks, home = i - w * p.group.num_ranks;
    t.home_w_local[w][home] = static_cast<const char*>(
        peer_address(p.group, mailbox_slot(kOpPrefetch, w), home));
  }
}

enum class CopyKind { kSkip, kZero, kVector, kBulk };

// One (weight array, slot) pair: its expert's bytes at the home rank and the slot's bytes.
struct Pair {
  const char* src;  // nullptr for a slot without an expert
  char* dst;
  int64_t bytes;
  CopyKind kind;
};

__device__ Pair pair_of(const PrefetchParams& p, const Tables& t, int w, int b) {
  const PrefetchWeight& weight = p.weights[w];
  char* dst = static_cast<char*>(weight.w_slots) + b * weight.expert_bytes;
  const int32_t expert = t.slot_expert[b];
  if (expert < 0)
    return {nullptr, dst, weight.expert_bytes, p.zero_unused_slots ? CopyKind::kZero
                                                                   : CopyKind::kSkip};
  const int home = expert / p.experts_per_rank;
  const char* src =
      t.home_w_local[w][home] + (expert - home * p.experts_per_rank) * weight.expert_bytes;
  const bool bulk = (reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                     static_cast<uintptr_t>(weight.expert_bytes)) % kBulkAlign == 0;
  return {src, dst, weight.expert_bytes, bulk ? CopyKind::kBulk : CopyKind::kVector};
}

// This CTA's byte range [begin, end) of a pair: every pair is split evenly over the grid, in
// multiples of 16 bytes (so that a bulk pair's ranges stay bulk-sized and aligned).
struct Range {
  int64_t begin, end;
};

__device__ Range cta_range(int64_t bytes) {
  const int64_t per_cta = (bytes + gridDim.x - 1) / gridDim.x;
  const int64_t share = (per_cta + kBulkAlign - 1) / kBulkAlign * kBulkAlign;
  const int64_t begin = min(static_cast<int64_t>(blockIdx.x) * share, bytes);
  return {begin, min(begin + share, bytes)};
}

// ---- vector copies: slots to zero and pairs that bulk copies cannot move ---------------------

template <typename Vec>
__device__ void copy_vectors(const char* src, char* dst, Range r, int thread, int threads) {
  const Vec* in = src ? reinterpret_cast<const Vec*>(src + r.begin) : nullptr;
  Vec* out = reinterpret_cast<Vec*>(dst + r.begin);
  const int64_t n = (r.end - r.begin) / static_cast<int64_t>(sizeof(Vec));
  for (int64_t base = thread; base < n; base += int64_t{threads} * kUnroll) {
    Vec v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      // __ldcg: L2 only, so that no stale L1 line of an earlier call is served (combine.cu).
      const int64_t i = base + int64_t{u} * threads;
      if (i < n) v[u] = in ? __ldcg(in + i) : Vec{};
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t{u} * threads;
      if (i < n) out[i] = v[u];
    }
  }
}

// The widest vector that divides the pair's addresses and size (experts are multiples of 2 bytes).
__device__ void copy_pair_vectors(const Pair& pair, Range r, int thread, int threads) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(pair.src) |
                         reinterpret_cast<uintptr_t>(pair.dst) |
                         static_cast<uintptr_t>(pair.bytes);
  if (bits % 16 == 0) {
    copy_vectors<uint4>(pair.src, pair.dst, r, thread, threads);
  } else if (bits % 4 == 0) {
    copy_vectors<uint32_t>(pair.src, pair.dst, r, thread, threads);
  } else {
    copy_vectors<uint16_t>(pair.src, pair.dst, r, thread, threads);
  }
}

__device__ void vector_copies(const PrefetchParams& p, const Tables& t, int thread, int threads) {
  for (int w = 0; w < p.num_weights; ++w) {
    for (int b = 0; b < p.num_slots; ++b) {
      const Pair pair = pair_of(p, t, w, b);
      if (pair.kind == CopyKind::kZero || pair.kind == CopyKind::kVector)
        copy_pair_vectors(pair, cta_range(pair.bytes), thread, threads);
    }
  }
}

// ---- bulk copies -------------------------------------------------------------------------------

struct Chunk {
  const char* src;
  char* dst;
  uint32_t bytes;
};

// Walks this CTA's bulk chunks in order: every bulk pair's range, kStageBytes at a time.
struct BulkChunks {
  const PrefetchParams& p;
  const Tables& t;
  int pair = -1;  // w * num_slots + b of the current range
  Pair current{};
  Range range{0, 0};

  __device__ bool next(Chunk& chunk) {
    while (range.begin == range.end) {
      if (++pair >= p.num_weights * p.num_slots) return false;
      current = pair_of(p, t, pair / p.num_slots, pair % p.num_slots);
      range = current.kind == CopyKind::kBulk ? cta_range(current.bytes) : Range{0, 0};
    }
    const int64_t bytes = min(static_cast<int64_t>(kStageBytes), range.end - range.begin);
    chunk = {current.src + range.begin, current.dst + range.begin, static_cast<uint32_t>(bytes)};
    range.begin += bytes;
    return true;
  }
};

// One thread. Bulk copies read through L2 and never allocate in L1 (the TMA unit moves global
// memory to shared memory by way of L2), so, like the vector path's __ldcg, they cannot be served
// a stale L1 line of a peer's w_local from an earlier call. Peer memory is mapped into this
// process (UVA, or CUDA IPC / VMM for a peer process), so a peer's w_local is a plain global
// address to them.
__device__ void bulk_copies(const PrefetchParams& p, const Tables& t, char* stages,
                            uint64_t* full) {
  for (int s = 0; s < kStages; ++s) mbarrier_init(&full[s]);
  fence_mbarrier_init();
  BulkChunks chunks{p, t};
  Chunk staged[kStages];
  int loaded = 0;
  for (; loaded < kStages && chunks.next(staged[loaded]); ++loaded)
    bulk_load(stages + loaded * kStageBytes, staged[loaded].src, staged[loaded].bytes,
              &full[loaded]);
  // Chunk i lives in stage i % kStages; its load completes phase i / kStages of that stage's
  // mbarrier. After storing chunk i, the stage of chunk i - 1 is refilled with chunk
  // i - 1 + kStages once that store has read it.
  for (int i = 0; i < loaded; ++i) {
    const int s = i % kStages;
    mbarrier_wait(&full[s], (i / kStages) & 1);
    fence_proxy_async_shared();
    bulk_store(staged[s].dst, stages + s * kStageBytes, staged[s].bytes);
    if (i == 0) continue;
    const int refill = (i - 1) % kStages;
    Chunk chunk;
    if (!chunks.next(chunk)) continue;
    bulk_wait_read<1>();  // every store but chunk i's has read its stage
    staged[refill] = chunk;
    bulk_load(stages + refill * kStageBytes, chunk.src, chunk.bytes, &full[refill]);
    ++loaded;
  }
  bulk_wait_all();  // the stages stay allocated, and w_slots written, before the CTA exits
}

// Warp 0 streams the bulk pairs (one thread issues, TMA moves the bytes) while the other warps
// zero unused slots and copy the pairs bulk copies cannot move with vector loads and stores.
__global__ void __launch_bounds__(kThreads) prefetch_copy_kernel(PrefetchParams p) {
  extern __shared__ __align__(128) char stages[];
  __shared__ Tables tables;
  __shared__ uint64_t full[kStages];
  load_tables(p, tables);
  __syncthreads();
  if (threadIdx.x == 0) {
    bulk_copies(p, tables, stages, full);
  } else if (threadIdx.x >= kWarpSize) {
    vector_copies(p, tables, threadIdx.x - kWarpSize, kThreads - kWarpSize);
  }
}

[[maybe_unused]] const int kPreloaded[] = {
    register_kernel_for_preload(as_symbol(&prefetch_copy_kernel)),
};

}  // namespace

cudaError_t launch_prefetch(const PrefetchParams& p, cudaStream_t stream) {
  if (p.num_weights < 1 || p.num_weights > kMaxPrefetchWeights || p.num_slots > kMaxSlots)
    return cudaErrorInvalidValue;
  cudaError_t err = cudaFuncSetAttribute(
      prefetch_copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kStagesBytes);
  if (err != cudaSuccess) return err;
  PublishedAddresses published{};
  for (int w = 0; w < p.num_weights; ++w) published.address[w] = p.weights[w].w_local;
  err = launch_entry_rendezvous(p.group, kOpPrefetch, published, stream);
  if (err != cudaSuccess) return err;
  prefetch_copy_kernel<<<p.num_sms, kThreads, kStagesBytes, stream>>>(p);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  return launch_exit_rendezvous(p.group, kOpPrefetch, stream);
}

}  // namespace moonep
