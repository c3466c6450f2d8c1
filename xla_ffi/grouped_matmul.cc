// XLA FFI handlers of the grouped GEMMs: moonep_grouped_matmul, moonep_grouped_matmul_dx,
// moonep_grouped_matmul_dw. Shapes come from the buffers; the EP rank is an int32 operand
// (lax.axis_index), read on device. Forward and dX can have inference-overflow groups exactly when
// B < epn (w_slots has fewer matrices than w_local): only then do they find the EP group from the
// transport attributes and rendezvous with the peers (kernels/grouped_matmul.h); with B == epn the
// attributes are unread.
#include "kernels/grouped_matmul.h"

#include <cuda_runtime.h>

#include <string>

#include "kernels/constants.h"
#include "xla/ffi/api/ffi.h"
#include "xla_ffi/shape_checks.h"
#include "xla_ffi/transport.h"

namespace ffi = xla::ffi;
using moonep::dims_str;
using moonep::has_shape;
using moonep::shape_error;

namespace {

ffi::Error cuda_error(const char* target, cudaError_t e) {
  return ffi::Error::Internal(std::string(target) + ": " + cudaGetErrorString(e));
}

// Checks w_local [epn, D0, D1], w_slots [B, D0, D1], cu_seqlens [G], ep_rank [1].
ffi::Error check_weights(const char* target, ffi::Buffer<ffi::BF16>& w_local,
                         ffi::Buffer<ffi::BF16>& w_slots, ffi::Buffer<ffi::S32>& cu_seqlens,
                         ffi::Buffer<ffi::S32>& ep_rank) {
  auto wl = w_local.dimensions();
  if (wl.size() != 3) return shape_error(target, "w_local", "[epn, D0, D1]", wl);
  if (!has_shape(w_slots.dimensions(),
                 {w_slots.dimensions().size() == 3 ? w_slots.dimensions()[0] : -1, wl[1], wl[2]}))
    return shape_error(target, "w_slots", "[B, D0, D1] with D0, D1 of w_local",
                       w_slots.dimensions());
  if (cu_seqlens.dimensions().size() != 1)
    return shape_error(target, "cu_seqlens", "[G]", cu_seqlens.dimensions());
  if (ep_rank.element_count() != 1)
    return shape_error(target, "ep_rank", "[1]", ep_rank.dimensions());
  return ffi::Error::Success();
}

// The transport attributes of the ragged-M handlers (see moonep_jax/_cuda/comm.py).
struct Transport {
  int32_t device_ordinal;
  ffi::Span<const int32_t> mesh_devices;
  int32_t num_ranks;
  int64_t timeout_ns;
};

ffi::Error GroupedMatmulRows(moonep::GroupedMatmulOp op, const char* target, cudaStream_t stream,
                             ffi::Buffer<ffi::BF16> in, ffi::Buffer<ffi::BF16> w_local,
                             ffi::Buffer<ffi::BF16> w_slots, ffi::Buffer<ffi::S32> cu_seqlens,
                             ffi::Buffer<ffi::S32> ep_rank, ffi::ResultBuffer<ffi::BF16> out,
                             ffi::ResultBuffer<ffi::S32> tile_table, const Transport& transport) {
  if (auto err = check_weights(target, w_local, w_slots, cu_seqlens, ep_rank); err.failure())
    return err;
  auto wl = w_local.dimensions();
  const int64_t d0 = wl[1], d1 = wl[2];
  const int64_t in_cols = op == moonep::GroupedMatmulOp::kForward ? d0 : d1;
  const int64_t out_cols = op == moonep::GroupedMatmulOp::kForward ? d1 : d0;
  auto in_dims = in.dimensions();
  if (in_dims.size() != 2 || in_dims[1] != in_cols)
    return shape_error(target, "x", "[NvS, " + std::to_string(in_cols) + "]", in_dims);
  const int64_t num_rows = in_dims[0];
  if (!has_shape(out->dimensions(), {num_rows, out_cols}))
    return shape_error(target, "out", "[NvS, " + std::to_string(out_cols) + "]", out->dimensions());
  const int64_t num_groups = cu_seqlens.dimensions()[0];
  const int64_t num_local = wl[0], num_slots = w_slots.dimensions()[0];
  const bool overflow = num_slots < num_local;
  const int64_t table_rows = moonep::grouped_matmul_table_rows(num_rows, num_groups, overflow);
  if (!has_shape(tile_table->dimensions(), {table_rows, moonep::kTableColumns}))
    return shape_error(target, "tile_table", dims_str({table_rows, moonep::kTableColumns}),
                       tile_table->dimensions());
  moonep::GroupView group{};
  if (overflow) {
    if (num_groups - num_slots != int64_t{transport.num_ranks} * num_local)
      return shape_error(target, "cu_seqlens",
                         "[G] with G = R * epn + B = " +
                             std::to_string(transport.num_ranks * num_local + num_slots),
                         cu_seqlens.dimensions());
    auto view = moonep::group_view(transport.device_ordinal, transport.mesh_devices,
                                   transport.num_ranks, transport.timeout_ns);
    if (view.has_error()) return view.error();
    group = *view;
  }
  const moonep::GroupedMatmulParams params{
      .op = op,
      .device = transport.device_ordinal,
      .in = in.untyped_data(),
      .w_local = w_local.untyped_data(),
      .w_slots = w_slots.untyped_data(),
      .out = out->untyped_data(),
      .cu_seqlens = cu_seqlens.typed_data(),
      .ep_rank = ep_rank.typed_data(),
      .tile_table = tile_table->typed_data(),
      .num_rows = static_cast<int32_t>(num_rows),
      .d0 = static_cast<int32_t>(d0),
      .d1 = static_cast<int32_t>(d1),
      .num_local = static_cast<int32_t>(num_local),
      .num_slots = static_cast<int32_t>(num_slots),
      .num_groups = static_cast<int32_t>(num_groups),
      .overflow = overflow,
      .group = group,
  };
  if (cudaError_t e = moonep::launch_grouped_matmul(params, stream); e != cudaSuccess)
    return cuda_error(target, e);
  return ffi::Error::Success();
}

ffi::Error GroupedMatmulImpl(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::BF16> x,
                             ffi::Buffer<ffi::BF16> w_local, ffi::Buffer<ffi::BF16> w_slots,
                             ffi::Buffer<ffi::S32> cu_seqlens, ffi::Buffer<ffi::S32> ep_rank,
                             ffi::ResultBuffer<ffi::BF16> y, ffi::ResultBuffer<ffi::S32> tile_table,
                             ffi::Span<const int32_t> mesh_devices, int32_t num_ranks,
                             int64_t timeout_ns) {
  return GroupedMatmulRows(moonep::GroupedMatmulOp::kForward, "moonep_grouped_matmul", stream, x,
                           w_local, w_slots, cu_seqlens, ep_rank, y, tile_table,
                           {device_ordinal, mesh_devices, num_ranks, timeout_ns});
}

ffi::Error GroupedMatmulDxImpl(cudaStream_t stream, int32_t device_ordinal,
                               ffi::Buffer<ffi::BF16> dy, ffi::Buffer<ffi::BF16> w_local,
                               ffi::Buffer<ffi::BF16> w_slots, ffi::Buffer<ffi::S32> cu_seqlens,
                               ffi::Buffer<ffi::S32> ep_rank, ffi::ResultBuffer<ffi::BF16> dx,
                               ffi::ResultBuffer<ffi::S32> tile_table,
                               ffi::Span<const int32_t> mesh_devices, int32_t num_ranks,
                               int64_t timeout_ns) {
  return GroupedMatmulRows(moonep::GroupedMatmulOp::kDx, "moonep_grouped_matmul_dx", stream, dy,
                           w_local, w_slots, cu_seqlens, ep_rank, dx, tile_table,
                           {device_ordinal, mesh_devices, num_ranks, timeout_ns});
}

ffi::Error GroupedMatmulDwImpl(
    cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::BF16> x,
    ffi::Buffer<ffi::BF16> dy, ffi::Buffer<ffi::S32> cu_seqlens, ffi::Buffer<ffi::S32> ep_rank,
    ffi::Buffer<ffi::S32> experts_to_copy, ffi::ResultBuffer<ffi::BF16> dw_local,
    ffi::ResultBuffer<ffi::F32> dw_partial, ffi::ResultBuffer<ffi::F32> dw_slots,
    ffi::ResultBuffer<ffi::S32> replica_flags, ffi::ResultBuffer<ffi::S32> schedule,
    int32_t zero_unused_slots) {
  constexpr const char* kTarget = "moonep_grouped_matmul_dw";
  auto xd = x.dimensions(), dyd = dy.dimensions(), wl = dw_local->dimensions();
  if (xd.size() != 2) return shape_error(kTarget, "x", "[NvS, D0]", xd);
  if (dyd.size() != 2 || dyd[0] != xd[0]) return shape_error(kTarget, "dy", "[NvS, D1]", dyd);
  if (!has_shape(wl, {wl.size() == 3 ? wl[0] : -1, xd[1], dyd[1]}))
    return shape_error(kTarget, "dw_local", "[epn, D0, D1]", wl);
  const int64_t epn = wl[0];
  auto wp = dw_partial->dimensions();
  if (!has_shape(wp, {wp.size() == 3 && wp[0] == 0 ? 0 : epn, xd[1], dyd[1]}))
    return shape_error(kTarget, "dw_partial", "[epn or 0, D0, D1]", wp);
  auto ws = dw_slots->dimensions();
  if (!has_shape(ws, {ws.size() == 3 ? ws[0] : -1, xd[1], dyd[1]}))
    return shape_error(kTarget, "dw_slots", "[B or 0, D0, D1]", ws);
  if (cu_seqlens.dimensions().size() != 1)
    return shape_error(kTarget, "cu_seqlens", "[G]", cu_seqlens.dimensions());
  if (ep_rank.element_count() != 1)
    return shape_error(kTarget, "ep_rank", "[1]", ep_rank.dimensions());
  if (experts_to_copy.dimensions().size() != 2)
    return shape_error(kTarget, "experts_to_copy", "[R, B]", experts_to_copy.dimensions());
  if (!has_shape(replica_flags->dimensions(), {epn}))
    return shape_error(kTarget, "replica_flags", "[epn]", replica_flags->dimensions());
  if (!has_shape(schedule->dimensions(), {moonep::kDwScheduleSlots + ws[0]}))
    return shape_error(kTarget, "schedule",
                       "[" + std::to_string(moonep::kDwScheduleSlots) + " + (B or 0)]",
                       schedule->dimensions());
  const moonep::GroupedMatmulDwParams params{
      .device = device_ordinal,
      .x = x.untyped_data(),
      .dy = dy.untyped_data(),
      .dw_local = dw_local->untyped_data(),
      .dw_partial = dw_partial->typed_data(),
      .dw_slots = dw_slots->typed_data(),
      .replica_flags = replica_flags->typed_data(),
      .schedule = schedule->typed_data(),
      .experts_to_copy = experts_to_copy.typed_data(),
      .cu_seqlens = cu_seqlens.typed_data(),
      .ep_rank = ep_rank.typed_data(),
      .num_rows = static_cast<int32_t>(xd[0]),
      .d0 = static_cast<int32_t>(xd[1]),
      .d1 = static_cast<int32_t>(dyd[1]),
      .num_local = static_cast<int32_t>(epn),
      .num_partials = static_cast<int32_t>(wp[0]),
      .num_slots = static_cast<int32_t>(ws[0]),
      .num_copies = static_cast<int32_t>(experts_to_copy.element_count()),
      .num_groups = static_cast<int32_t>(cu_seqlens.dimensions()[0]),
      .zero_unused_slots = zero_unused_slots != 0,
  };
  if (cudaError_t e = moonep::launch_grouped_matmul_dw(params, stream); e != cudaSuccess)
    return cuda_error(kTarget, e);
  return ffi::Error::Success();
}

}  // namespace

#define MOONEP_GROUPED_MATMUL_BINDING                                                              \
  ffi::Ffi::Bind()                                                                                 \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                                                    \
      .Ctx<ffi::DeviceOrdinal>()                                                                   \
      .Arg<ffi::Buffer<ffi::BF16>>()                  /* x (fwd) | dy (dX) [NvS, K] */             \
      .Arg<ffi::Buffer<ffi::BF16>>()                  /* w_local [epn, D0, D1] */                  \
      .Arg<ffi::Buffer<ffi::BF16>>()                  /* w_slots [B, D0, D1] */                    \
      .Arg<ffi::Buffer<ffi::S32>>()                   /* cu_seqlens [G] */                         \
      .Arg<ffi::Buffer<ffi::S32>>()                   /* ep_rank [1] */                            \
      .Ret<ffi::Buffer<ffi::BF16>>()                  /* y [NvS, D1] (fwd) | dx [NvS, D0] (dX) */  \
      .Ret<ffi::Buffer<ffi::S32>>()                   /* tile_table [table rows, kTableColumns] */ \
      .Attr<ffi::Span<const int32_t>>("mesh_devices") /* read only if B < epn */                   \
      .Attr<int32_t>("num_ranks")                                                                  \
      .Attr<int64_t>("timeout_ns")

// Capture-safe (XLA command buffers / CUDA graphs): the launchers allocate nothing, make no
// stream query that capture refuses (kernels/cutedsl/load_module.h) and every kernel they launch
// is loaded at bootstrap.
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoonepGroupedMatmul, GroupedMatmulImpl, MOONEP_GROUPED_MATMUL_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoonepGroupedMatmulDx, GroupedMatmulDxImpl,
                              MOONEP_GROUPED_MATMUL_BINDING, {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoonepGroupedMatmulDw, GroupedMatmulDwImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [NvS, D0]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // dy [NvS, D1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_seqlens [G]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ep_rank [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // experts_to_copy [R, B]
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // dw_local [epn, D0, D1]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dw_partial [epn | 0, D0, D1]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dw_slots [B | 0, D0, D1]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // replica_flags scratch [epn]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // schedule scratch (constants.h)
                                  .Attr<int32_t>("zero_unused_slots"),
                              {ffi::Traits::kCmdBufferCompatible});
