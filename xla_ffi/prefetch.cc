// XLA FFI handler `moonep_prefetch`: check buffers against each other, find this device's EP group,
// launch the zero-copy slot pull of every weight array (kernels/prefetch.cu).
//
// Operands: experts_to_copy, then the N weight arrays w_local; results: their N w_slots. N is
// variadic (RemainingArgs / RemainingRets) rather than a fixed maximum of optional buffers: one
// binding serves every N, no placeholder buffers travel, and the bound is checked here, once,
// against the one place it comes from (kMaxPrefetchWeights, the op's mailbox slots).
#include <cuda_runtime.h>

#include <string>

#include "kernels/prefetch.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/shape_checks.h"
#include "xla_ffi/transport.h"

namespace ffi = xla::ffi;
using moonep::dims_str;
using moonep::shape_error;

namespace {

constexpr const char* kOp = "moonep_prefetch";

// Weight array w's w_local and w_slots, checked against each other, B and the first array's epn.
ffi::Error decode_weight(const ffi::RemainingArgs& w_locals, const ffi::RemainingRets& w_slots,
                         size_t w, int64_t B, int64_t* epn, moonep::PrefetchWeight* weight) {
  const std::string index = "[" + std::to_string(w) + "]";
  auto local = w_locals.get<ffi::AnyBuffer>(w);
  if (local.has_error()) return local.error();
  auto slots = w_slots.get<ffi::AnyBuffer>(w);
  if (slots.has_error()) return slots.error();
  const auto w_dims = local->dimensions();
  if (w_dims.size() < 1 || w_dims[0] < 1 || (w > 0 && w_dims[0] != *epn))
    return shape_error(kOp, ("w_local" + index).c_str(),
                       w > 0 ? "[epn, ...] with the first w_local's epn = " + std::to_string(*epn)
                             : std::string("[epn, ...] with epn >= 1"),
                       w_dims);
  *epn = w_dims[0];
  const int64_t expert_bytes = local->size_bytes() / *epn;
  if (expert_bytes % 2 != 0)
    return ffi::Error::InvalidArgument(std::string(kOp) + ": `w_local" + index +
                                       "` must have a 2- or 4-byte dtype.");
  const auto s_dims = (*slots)->dimensions();
  bool slots_ok = s_dims.size() == w_dims.size() && s_dims[0] == B &&
                  (*slots)->element_type() == local->element_type();
  for (size_t i = 1; slots_ok && i < w_dims.size(); ++i) slots_ok = s_dims[i] == w_dims[i];
  if (!slots_ok)
    return shape_error(kOp, ("w_slots" + index).c_str(),
                       "[B, ...] = [" + std::to_string(B) + ", ...] with w_local" + index +
                           "'s trailing dims " + dims_str(w_dims) + " and dtype",
                       s_dims);
  *weight = {local->untyped_data(), (*slots)->untyped_data(), expert_bytes};
  return ffi::Error::Success();
}

ffi::Error PrefetchExecute(cudaStream_t stream, int32_t device_ordinal,
                           ffi::Buffer<ffi::S32> experts_to_copy, ffi::RemainingArgs w_locals,
                           ffi::RemainingRets w_slots, ffi::Span<const int32_t> mesh_devices,
                           int32_t num_ranks, int32_t num_sms, int64_t timeout_ns,
                           int32_t zero_unused_slots) {
  const size_t num_weights = w_locals.size();
  if (num_weights < 1 || num_weights > size_t{moonep::kMaxPrefetchWeights} ||
      w_slots.size() != num_weights)
    return ffi::Error::InvalidArgument(
        std::string(kOp) + ": takes 1 to " + std::to_string(moonep::kMaxPrefetchWeights) +
        " weight arrays (one mailbox slot each) and returns one w_slots per array; got " +
        std::to_string(num_weights) + " arrays and " + std::to_string(w_slots.size()) +
        " results.");
  const auto e2c_dims = experts_to_copy.dimensions();
  if (e2c_dims.size() != 2 || e2c_dims[0] != num_ranks || e2c_dims[1] < 1 ||
      e2c_dims[1] > moonep::kMaxExperts)
    return shape_error(kOp, "experts_to_copy",
                       "[R, B] with R = " + std::to_string(num_ranks) + ", 1 <= B <= " +
                           std::to_string(moonep::kMaxExperts),
                       e2c_dims);
  const int64_t B = e2c_dims[1];

  moonep::PrefetchParams params{};
  int64_t epn = 0;
  for (size_t w = 0; w < num_weights; ++w) {
    if (auto err = decode_weight(w_locals, w_slots, w, B, &epn, &params.weights[w]);
        err.failure())
      return err;
  }
  auto group = moonep::group_view(device_ordinal, mesh_devices, num_ranks, timeout_ns);
  if (group.has_error()) return group.error();
  params.group = *group;
  params.num_weights = static_cast<int32_t>(num_weights);
  params.experts_to_copy = experts_to_copy.typed_data();
  params.experts_per_rank = static_cast<int32_t>(epn);
  params.num_slots = static_cast<int32_t>(B);
  params.num_sms = num_sms;
  params.zero_unused_slots = zero_unused_slots != 0;
  MOONEP_CUDA_RETURN_IF_ERROR(kOp, moonep::launch_prefetch(params, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoonepPrefetch, PrefetchExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // experts_to_copy [R, B] i32
                                  .RemainingArgs()               // w_local[w] [epn, ...]
                                  .RemainingRets()               // w_slots[w] [B, ...] same dtype
                                  .Attr<ffi::Span<const int32_t>>("mesh_devices")
                                  .Attr<int32_t>("num_ranks")
                                  .Attr<int32_t>("num_sms")
                                  .Attr<int64_t>("timeout_ns")
                                  .Attr<int32_t>("zero_unused_slots"),
                              {ffi::Traits::kCmdBufferCompatible});
