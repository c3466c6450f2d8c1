"""CUDA backends (XLA FFI custom calls) of the moonep_jax ops, one module per area.

`transport` bootstraps the cross-GPU transport and builds the `mesh_devices` attribute every op
passes; `plan` is the planner; the communication ops live in `comm`. Each backend has the
signature fixed in docs/CONTRACT.md and runs per EP rank inside `jax.shard_map`. Importing these
modules needs no GPU; calling them needs the extension (`moonep_jax._ffi.available()`).
"""
