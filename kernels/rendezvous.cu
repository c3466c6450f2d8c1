#include "kernels/rendezvous.h"

namespace moonep {
namespace {

// One CTA of one warp: the barrier needs a thread per rank.
__global__ void entry_rendezvous_kernel(GroupView g, int op_slot, PublishedAddresses addresses) {
  __shared__ uint32_t epoch;
  if (threadIdx.x == 0) {
    epoch = next_epoch(g, op_slot);
    for (int i = 0; i < kMailboxesPerOp; ++i) {
      if (addresses.address[i] != nullptr)
        publish(g, mailbox_slot(op_slot, i), addresses.address[i]);
    }
  }
  __syncthreads();
  barrier(g, barrier_slot(op_slot, 0), epoch, "the entry barrier of a zero-copy op");
}

__global__ void middle_rendezvous_kernel(GroupView g, int op_slot) {
  barrier(g, barrier_slot(op_slot, 2), current_epoch(g, op_slot),
          "the middle barrier of a zero-copy op");
}

__global__ void exit_rendezvous_kernel(GroupView g, int op_slot) {
  barrier(g, barrier_slot(op_slot, 1), current_epoch(g, op_slot),
          "the exit barrier of a zero-copy op");
}

// Loaded on every device when a transport context is created (lazy loading while a peer spins
// in a barrier can deadlock).
[[maybe_unused]] const int kPreloaded[] = {
    register_kernel_for_preload(as_symbol(&entry_rendezvous_kernel)),
    register_kernel_for_preload(as_symbol(&middle_rendezvous_kernel)),
    register_kernel_for_preload(as_symbol(&exit_rendezvous_kernel)),
};

}  // namespace

cudaError_t launch_entry_rendezvous(const GroupView& group, int op_slot,
                                    const PublishedAddresses& addresses, cudaStream_t stream) {
  entry_rendezvous_kernel<<<1, 32, 0, stream>>>(group, op_slot, addresses);
  return cudaGetLastError();
}

// The middle and exit barriers of a group of one wait for nobody and publish nothing (stream
// order orders its kernels): not launched, which saves a launch and ~4 us of kernel at R = 1.
cudaError_t launch_middle_rendezvous(const GroupView& group, int op_slot, cudaStream_t stream) {
  if (group.num_ranks == 1) return cudaSuccess;
  middle_rendezvous_kernel<<<1, 32, 0, stream>>>(group, op_slot);
  return cudaGetLastError();
}

cudaError_t launch_exit_rendezvous(const GroupView& group, int op_slot, cudaStream_t stream) {
  if (group.num_ranks == 1) return cudaSuccess;
  exit_rendezvous_kernel<<<1, 32, 0, stream>>>(group, op_slot);
  return cudaGetLastError();
}

}  // namespace moonep
