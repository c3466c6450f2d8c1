"""The CUDA transport seen from Python: `bootstrap` and the `mesh_ordinals` attribute.

Every CUDA op passes `mesh_ordinals`, the CUDA ordinals of the concrete mesh's devices as a
row-major `[num_groups, R]` int32 table (one row per EP group, rank = column = position on the EP
axis, the other mesh axes flattened row-major into the rows). A handler finds its own device in
it, and with it its EP group and rank; the group's transport context (one small symmetric area per
GPU, peer access) lives in the extension, created once per group.

Inside `jax.shard_map` only the abstract mesh is public. The concrete mesh is found, in order:
1. the mesh set with `jax.set_mesh(mesh)` (read through jax's private `get_concrete_mesh`);
2. a mesh registered with `moonep_jax.bootstrap(mesh, axis_name)` whose axis names and sizes
   match the abstract mesh.
Without either, the op raises and names `moonep_jax.bootstrap`.
"""

from __future__ import annotations

import threading

import jax
import numpy as np

from moonep_jax import _ffi

# (axis names and sizes of the mesh, EP axis name) -> {table bytes: [num_groups, R] int32 table}
_registered: dict[tuple, dict[bytes, np.ndarray]] = {}
_lock = threading.Lock()


def bootstrap(mesh: jax.sharding.Mesh, axis_name: str = "ep") -> None:
    """Creates the CUDA transport of every EP group of `mesh` that this process drives.

    Call it once after building the mesh, before the first jitted call of a CUDA op (it is also
    done implicitly when the op is traced under `jax.set_mesh(mesh)`). Repeated calls are cheap.
    It allocates a small symmetric area on each GPU, enables peer access inside each group and
    loads every kernel, so nothing of that happens while kernels run.

    Args:
      mesh: a concrete `jax.sharding.Mesh` of GPUs.
      axis_name: the EP mesh axis (`EPConfig.axis_name`).

    Raises:
      TypeError / ValueError: `mesh` is not a concrete mesh, lacks `axis_name`, is not made of
        GPUs, or an EP group is larger than the transport supports.
      NotImplementedError: an EP group spans several processes (one process per GPU).
      RuntimeError: the extension is unavailable, or CUDA failed (the message says where).
    """
    table = ordinals_table(mesh, axis_name)
    key = (_shape_of(mesh), axis_name)
    with _lock:
        if table.tobytes() in _registered.get(key, {}):
            return
    lib = _ffi.lib()
    if table.shape[1] > lib.MAX_RANKS:
        raise ValueError(
            f"`moonep_jax.bootstrap`: the EP axis `{axis_name}` has {table.shape[1]} devices; the "
            f"CUDA transport supports at most {lib.MAX_RANKS} ranks per EP group.")
    for row in table:
        lib.bootstrap([int(o) for o in row])
    with _lock:
        _registered.setdefault(key, {})[table.tobytes()] = table


def mesh_ordinals(cfg) -> np.ndarray:
    """The `mesh_ordinals` attribute for a CUDA op traced inside `jax.shard_map`.

    Args:
      cfg: the layer's `EPConfig` (its `axis_name` is the EP axis).

    Returns:
      The `[num_groups, R]` int32 table, flattened row-major (FFI attributes are 1-D).

    Raises:
      ValueError: not traced inside `jax.shard_map` over `cfg.axis_name`, or no concrete mesh with
        the traced mesh's axes is known (call `moonep_jax.bootstrap(mesh, axis_name)`), or several
        are and the choice is ambiguous.
    """
    axis_name = cfg.axis_name
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty or axis_name not in abstract.axis_names:
        raise ValueError(
            f"CUDA ops must run inside `jax.shard_map` over a mesh with the EP axis `{axis_name}` "
            f"(`EPConfig.axis_name`); the current mesh is {abstract}.")
    shape = tuple(zip(abstract.axis_names, abstract.axis_sizes))
    concrete = _concrete_mesh()
    if concrete is not None and _shape_of(concrete) == shape:
        bootstrap(concrete, axis_name)
        return ordinals_table(concrete, axis_name).reshape(-1)
    with _lock:
        tables = list(_registered.get((shape, axis_name), {}).values())
    if len(tables) == 1:
        return tables[0].reshape(-1)
    if not tables:
        raise ValueError(
            f"The CUDA ops cannot see which devices the mesh {dict(shape)} is made of: call "
            f"`moonep_jax.bootstrap(mesh, axis_name={axis_name!r})` once after building the mesh, "
            "or trace under `jax.set_mesh(mesh)`.")
    raise ValueError(
        f"{len(tables)} different meshes with axes {dict(shape)} were passed to "
        "`moonep_jax.bootstrap`; trace under `jax.set_mesh(mesh)` to say which one this call uses.")


def ordinals_table(mesh: jax.sharding.Mesh, axis_name: str) -> np.ndarray:
    """`[num_groups, R] int32`: CUDA ordinals of the EP groups of `mesh` that this process drives.

    Raises:
      ValueError: a group is not made of GPUs (see also `ep_groups`).
    """
    groups = ep_groups(mesh, axis_name)
    for group in groups:
        if any(d.platform != "gpu" for d in group):
            raise ValueError(
                f"`moonep_jax.bootstrap`: the CUDA transport needs GPU devices; the EP group has "
                f"{sorted({d.platform for d in group})} devices.")
    return np.asarray([[d.local_hardware_id for d in group] for group in groups], np.int32)


def ep_groups(mesh: jax.sharding.Mesh, axis_name: str) -> list[list[jax.Device]]:
    """The EP groups of `mesh` that this process drives, each in EP rank order.

    A group is the devices that share every non-EP mesh coordinate; groups are ordered row-major
    over the other axes. Groups made only of other processes' devices are left out.

    Raises:
      TypeError / ValueError: `mesh` is not a concrete mesh, lacks `axis_name`, or has no device of
        this process.
      NotImplementedError: a group spans several processes (one process per GPU).
    """
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"`moonep_jax.bootstrap`: `mesh` must be a concrete jax.sharding.Mesh; got "
            f"{type(mesh).__name__}.")
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"`moonep_jax.bootstrap`: the mesh has no axis `{axis_name}` (`EPConfig.axis_name`); "
            f"its axes are {mesh.axis_names}.")
    ep = mesh.axis_names.index(axis_name)
    rows = np.moveaxis(mesh.devices, ep, -1).reshape(-1, mesh.devices.shape[ep])
    process = jax.process_index()
    groups = []
    for row in rows:
        local = [d.process_index == process for d in row]
        if not any(local):
            continue
        if not all(local):
            raise NotImplementedError(
                f"`moonep_jax.bootstrap`: the EP group {list(row)} spans several processes; the "
                "CUDA transport drives one process's GPUs (one process per GPU is not supported "
                "yet). Put the EP axis inside one process, or use implementation='xla'.")
        groups.append(list(row))
    if not groups:
        raise ValueError("`moonep_jax.bootstrap`: no device of the mesh belongs to this process.")
    return groups


def _shape_of(mesh) -> tuple:
    return tuple(zip(mesh.axis_names, mesh.devices.shape))


def _concrete_mesh() -> jax.sharding.Mesh | None:
    """The mesh set with `jax.set_mesh`, readable while tracing (private jax API; None if absent)."""
    try:
        from jax._src import mesh as mesh_lib

        mesh = mesh_lib.get_concrete_mesh()
    except (ImportError, AttributeError):
        return None
    return None if mesh is None or mesh.empty else mesh
