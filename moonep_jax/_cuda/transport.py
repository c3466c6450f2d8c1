"""The CUDA transport seen from Python: `bootstrap`, the `mesh_devices` attribute, error records.

**Bootstrap is explicit and complete before tracing.** `moonep_jax.bootstrap(mesh, axis_name)`
creates the transport of every EP group of `mesh` that has a device of this process (a group is
the devices sharing every non-EP coordinate; rank = position on the EP axis). Tracing a CUDA op
has no side effect: it only looks up the registered mesh, and an op traced for a mesh that was
not bootstrapped raises, naming `moonep_jax.bootstrap`.

Every CUDA op passes `mesh_devices`, the JAX device ids of the mesh as a row-major
`[num_groups, R]` int32 table (identical in every process); a handler finds its own device in it,
and with it its group and rank.

**Several processes.** A group whose devices belong to several processes of one host (one
process per GPU, several GPUs per process, or N processes sharing one GPU under MPS) is set up
here, collectively by those processes: each exports its XLA memory pool (one VMM allocation,
found from a fresh array's device pointer) as a POSIX file descriptor and its transport area as
a CUDA IPC handle, publishes them with its process id and pool base through jax.distributed's
key-value store (`moonep_jax._distributed`), takes every peer's descriptor with `pidfd_getfd`,
and maps every peer's pool once. Per call the kernels move a peer's published addresses into
that mapping (kernels/transport.cuh, `peer_address`), so the same kernels serve one process and
many. Refused at bootstrap, naming the setting: `XLA_PYTHON_CLIENT_ALLOCATOR` other than the
default BFC pool, `XLA_PYTHON_CLIENT_PREALLOCATE=false` (the pool could grow past the mapping),
and a group spanning hosts (EP stays inside one NVLink domain; use XLA's collectives across
hosts, e.g. a ("data", "ep") mesh with "data" across hosts).

**Errors the kernels record** (bad plan data: skipped, never written through; an expired wait,
which also traps) stay in a record per area, mirrored by the kernel into mapped pinned host
memory; `check_transport_errors()` reads the mirrors with plain loads (no CUDA call, no sync with
XLA's streams, still readable after a trap lost the CUDA context) and raises. Call it where a
step already syncs (after logging a loss, at a checkpoint); the GPU tests call it after every
test.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import threading

import jax
import numpy as np

from moonep_jax import _distributed, _ffi

# Bound of every wait of a multi-process bootstrap (a peer that never arrives).
BOOTSTRAP_TIMEOUT_S = 120.0
_SYS_PIDFD_GETFD = 438
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

# (axis names and sizes of the mesh, EP axis name) -> {table bytes: [num_groups, R] int32 ids}
_registered: dict[tuple, dict[bytes, np.ndarray]] = {}
_groups: set[tuple[int, ...]] = set()  # device ids of the groups registered in the extension
_sm_counts: dict[int, int | None] = {}  # device id -> SMs (JAX's core_count), local devices
_on_one_gpu: dict[tuple[int, ...], bool] = {}  # group's device ids -> whether they share a GPU
_pools: dict[tuple[int, int], int] = {}  # (peer pid, peer pool base) -> mapped base here
_lock = threading.Lock()


class TransportError(RuntimeError):
    """A device-side error record of the CUDA transport (see `check_transport_errors`)."""


def bootstrap(mesh: jax.sharding.Mesh, axis_name: str = "ep", *,
              timeout_s: float = BOOTSTRAP_TIMEOUT_S) -> None:
    """Creates the CUDA transport of every EP group of `mesh` that has a device of this process.

    Call it once after building the mesh, in every process of the job, before the first CUDA op
    is traced (repeated calls are cheap). It allocates a small symmetric area per device,
    enables peer access, loads every kernel and, for groups spanning processes, maps every
    peer's XLA pool once, so that nothing of that happens while kernels run.

    Args:
      mesh: a concrete `jax.sharding.Mesh` of GPUs.
      axis_name: the EP mesh axis (`EPConfig.axis_name`).
      timeout_s: bound of every wait for a peer process.

    Raises:
      TypeError / ValueError: `mesh` is not a concrete mesh, lacks `axis_name`, is not made of
        GPUs, an EP group is larger than the transport supports, or spans several hosts.
      RuntimeError: the extension is unavailable, a setting makes XLA's pool unmappable (the
        message names it), or CUDA failed (the message says where).
      TimeoutError: a peer process did not take part within `timeout_s`.
      TransportError: a kernel recorded an error since the last check (bootstrap is one of the
        points where records are read; see `check_transport_errors`).
    """
    check_transport_errors()
    table = device_table(mesh, axis_name)
    key = (_shape_of(mesh), axis_name)
    with _lock:
        if table.tobytes() in _registered.get(key, {}):
            return
    lib = _ffi.lib()
    if table.shape[1] > lib.MAX_RANKS:
        raise ValueError(
            f"`moonep_jax.bootstrap`: the EP axis `{axis_name}` has {table.shape[1]} devices; the "
            f"CUDA transport supports at most {lib.MAX_RANKS} ranks per EP group.")
    for group in ep_groups(mesh, axis_name):
        ids = tuple(d.id for d in group)
        if ids in _groups:
            continue
        for d in group:
            if d.process_index == jax.process_index():
                _sm_counts[d.id] = getattr(d, "core_count", None)
        if all(d.process_index == jax.process_index() for d in group):
            lib.register_group([(d.id, d.local_hardware_id, 0, 0, 0, 0) for d in group])
            one_gpu = len(group) == 1  # one process's JAX devices are distinct GPUs
        else:
            one_gpu = _bootstrap_across_processes(lib, group, timeout_s)
        with _lock:
            _on_one_gpu[ids] = one_gpu
        _groups.add(ids)
    with _lock:
        _registered.setdefault(key, {})[table.tobytes()] = table


def mesh_devices(cfg) -> np.ndarray:
    """The `mesh_devices` attribute for a CUDA op traced inside `jax.shard_map` (no side effect).

    Inside a trace only the abstract mesh is known: the table is made of the groups of every
    mesh registered with `moonep_jax.bootstrap` whose axis names and sizes match it (meshes over
    different devices, such as pipeline stages, may share a shape; each device finds its own
    group).

    Returns:
      The `[num_groups, R]` int32 table of device ids, flattened (FFI attributes are 1-D).

    Raises:
      ValueError: not traced inside `jax.shard_map` over `cfg.axis_name`, or no such mesh was
        bootstrapped (the message names `moonep_jax.bootstrap`), or two bootstrapped meshes of
        this shape put one device in different EP groups.
    """
    axis_name = cfg.axis_name
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty or axis_name not in abstract.axis_names:
        raise ValueError(
            f"CUDA ops must run inside `jax.shard_map` over a mesh with the EP axis `{axis_name}` "
            f"(`EPConfig.axis_name`); the current mesh is {abstract}.")
    shape = tuple(zip(abstract.axis_names, abstract.axis_sizes))
    with _lock:
        tables = list(_registered.get((shape, axis_name), {}).values())
    if not tables:
        raise ValueError(
            f"The mesh {dict(shape)} was not bootstrapped for the CUDA ops: call "
            f"`moonep_jax.bootstrap(mesh, axis_name={axis_name!r})` once after building the "
            "mesh, in every process, before tracing.")
    rows = sorted({tuple(int(i) for i in row) for table in tables for row in table})
    seen: dict[int, tuple] = {}
    for row in rows:
        for i in row:
            if seen.setdefault(i, row) != row:
                raise ValueError(
                    f"Two meshes with axes {dict(shape)} passed to `moonep_jax.bootstrap` put "
                    f"device {i} in different EP groups ({list(seen[i])} and {list(row)}); "
                    "name their EP axes differently (`EPConfig.axis_name`).")
    return np.asarray(rows, np.int32).reshape(-1)


def comm_ctas(cfg, mesh_devices: np.ndarray) -> int:
    """CTAs of the communication kernels of an op traced with the `mesh_devices` attribute (no side
    effect): `cfg.cuda.num_sms`, or else one per SM of this process's devices among them (the
    fewest, should they differ)."""
    if cfg.cuda.num_sms is not None:
        return cfg.cuda.num_sms
    with _lock:
        counts = [_sm_counts[i] for i in map(int, mesh_devices) if i in _sm_counts]
    if not counts or not all(isinstance(c, int) and c > 0 for c in counts):
        raise RuntimeError(
            f"JAX does not report the SM count (`core_count`) of this process's EP devices "
            f"({counts}); set `CudaOptions(num_sms=...)` in the EPConfig.")
    return min(counts)


def combine_on_owner(cfg, mesh_devices: np.ndarray) -> bool:
    """Whether combine sums a token's rows on the rank that holds them, for an op traced with the
    `mesh_devices` attribute (no side effect): `CudaOptions.combine_on_owner`, or else unless
    the EP groups of the table that this process bootstrapped share one GPU each. Every process
    of a group decides alike: bootstrap told each one every member's GPU.

    Raises:
      ValueError: some of those groups share one GPU and others do not (the processes of a
        group could then decide differently); set `CudaOptions.combine_on_owner`.
    """
    if cfg.cuda.combine_on_owner is not None:
        return cfg.cuda.combine_on_owner
    groups = {tuple(int(i) for i in row) for row in np.reshape(mesh_devices, (-1, cfg.num_ranks))}
    with _lock:
        known = {group: _on_one_gpu[group] for group in groups if group in _on_one_gpu}
    if len(set(known.values())) > 1:
        raise ValueError(
            f"The EP groups {sorted(known)} of this mesh differ in whether their ranks share one "
            "GPU, so combine cannot pick where its first stage runs for all of them alike: set "
            "`CudaOptions(combine_on_owner=True)` (ranks on separate GPUs) or `False`.")
    return not (known and all(known.values()))


def device_table(mesh: jax.sharding.Mesh, axis_name: str) -> np.ndarray:
    """`[num_groups, R] int32`: JAX device ids of every EP group of `mesh`, in rank order.

    Raises:
      ValueError: a group with a device of this process is not made of GPUs (see `ep_groups`).
    """
    for group in ep_groups(mesh, axis_name):
        if any(d.platform != "gpu" for d in group):
            raise ValueError(
                f"`moonep_jax.bootstrap`: the CUDA transport needs GPU devices; the EP group has "
                f"{sorted({d.platform for d in group})} devices.")
    return np.asarray([[d.id for d in row] for row in _rows(mesh, axis_name)], np.int32)


def ep_groups(mesh: jax.sharding.Mesh, axis_name: str) -> list[list[jax.Device]]:
    """The EP groups of `mesh` that have a device of this process, each in EP rank order.

    A group is the devices that share every non-EP mesh coordinate; groups are ordered row-major
    over the other axes. A group may span processes (see the module docstring).

    Raises:
      TypeError / ValueError: `mesh` is not a concrete mesh, lacks `axis_name`, or has no device of
        this process.
    """
    process = jax.process_index()
    groups = [list(row) for row in _rows(mesh, axis_name)
              if any(d.process_index == process for d in row)]
    if not groups:
        raise ValueError("`moonep_jax.bootstrap`: no device of the mesh belongs to this process.")
    return groups


def transport_errors(clear: bool = True) -> list[dict]:
    """Every device-side error record of this process's transport areas (empty without the
    extension); `clear` resets them. Each is a dict with device_id, code, code_name, rank,
    epoch, slot, detail and what."""
    if not _ffi.available() or not _groups:
        return []
    return list(_ffi.lib().transport_errors(clear))


def check_transport_errors() -> None:
    """Raises `TransportError` if a kernel recorded an error since the last check (and clears it).

    Reads the host-mapped mirror of each transport area's record of this process: plain loads,
    no sync with XLA's streams, nothing per call (clearing a record that holds an error resets
    it on a private stream). Errors that trap (a barrier timeout, a bad expert id) also surface
    as the failed computation's exception, and their record names the rank, the epoch and what
    was awaited; bad plan data (the entry was skipped) surfaces only here.
    """
    errors = transport_errors(clear=True)
    if errors:
        raise TransportError("moonep_jax: the CUDA transport recorded errors:\n  "
                             + "\n  ".join(map(describe_error, errors)))


def describe_error(e: dict) -> str:
    """One line for a record of `transport_errors()`."""
    return (f"JAX device {e['device_id']}: {e['code_name']} at EP rank {e['rank']}, epoch "
            f"{e['epoch']}: {e['what']} (value {e['detail']})")


# ---- several processes --------------------------------------------------------------------------

def check_pool_settings() -> None:
    """Refuses the XLA allocator settings under which a peer's pool cannot be mapped once."""
    allocator = os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default").lower()
    if allocator not in ("default", "bfc", ""):
        raise RuntimeError(
            f"`moonep_jax.bootstrap`: XLA_PYTHON_CLIENT_ALLOCATOR={allocator!r}: an EP group "
            "spanning processes maps each peer's XLA memory pool once, which needs XLA's default "
            "BFC pool (one VMM allocation); 'platform' and 'vmm' allocate per buffer and "
            "'cuda_async' cannot be exported. Unset XLA_PYTHON_CLIENT_ALLOCATOR.")
    preallocate = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower()
    if preallocate in ("false", "0", "no"):
        raise RuntimeError(
            "`moonep_jax.bootstrap`: XLA_PYTHON_CLIENT_PREALLOCATE=false: the pool would grow "
            "in new regions after bootstrap that peers have not mapped. Leave preallocation on "
            "(size the pool with XLA_PYTHON_CLIENT_MEM_FRACTION).")


def host_id() -> str:
    """This host's identity: the hostname and the kernel's boot id (one per running kernel)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _bootstrap_across_processes(lib, group: list[jax.Device], timeout_s: float) -> bool:
    """Registers `group` (devices of several processes); returns whether they share one GPU."""
    check_pool_settings()
    me = jax.process_index()
    tag = "moonep_jax/transport/" + "-".join(str(d.id) for d in group)
    local = [d for d in group if d.process_index == me]
    ordinals = [d.local_hardware_id for d in local]
    processes = sorted({d.process_index for d in group})
    host = host_id()
    own, exported = {}, []
    _allow_peers_to_take_fds(True)
    try:
        for d in local:
            area, handle = lib.create_shared_area(d.local_hardware_id)
            fd, base, size = _export_pool(lib, d)
            exported.append(fd)
            own[d.id] = area
            _distributed.put(f"{tag}/{d.id}", json.dumps(dict(
                pid=os.getpid(), fd=fd, base=base, size=size, area=handle.hex(), host=host,
                pci=lib.pci_bus_id(d.local_hardware_id))))
        peers = {}
        for d in group:
            if d.process_index != me:
                peers[d.id] = json.loads(_distributed.get(
                    f"{tag}/{d.id}", timeout_s,
                    f"the transport handles of JAX device {d.id} (process {d.process_index})"))
        hosts = {d.id: host for d in local} | {i: p["host"] for i, p in peers.items()}
        if len(set(hosts.values())) > 1:
            raise ValueError(
                f"`moonep_jax.bootstrap`: the EP group of JAX devices {[d.id for d in group]} "
                f"spans several hosts ({sorted(set(hosts.values()))}); EP groups must stay inside "
                "one host (NVLink domain). Put the EP axis inside a host and the data axes "
                "across hosts, e.g. Mesh(devices.reshape(num_hosts, -1), ('data', 'ep')).")
        ranks = []
        for d in group:
            if d.process_index == me:
                ranks.append((d.id, d.local_hardware_id, own[d.id], 0, 0, 0))
                continue
            p = peers[d.id]
            mapped = _pools.get((p["pid"], p["base"]))
            if mapped is None:
                fd = _take_fd(p["pid"], p["fd"], d)
                try:
                    mapped = lib.map_pool(fd, p["size"], ordinals)
                finally:
                    os.close(fd)
                _pools[(p["pid"], p["base"])] = mapped
            area = lib.open_shared_area(ordinals, bytes.fromhex(p["area"]), p["pci"])
            ranks.append((d.id, -1, area, p["base"], p["size"], mapped))
        # Every peer holds its own descriptors now.
        _distributed.barrier(f"{tag}/mapped", timeout_s, processes)
    finally:
        _allow_peers_to_take_fds(False)
        for fd in exported:
            os.close(fd)
    lib.register_group(ranks)
    _distributed.barrier(f"{tag}/ready", timeout_s, processes)
    return len({lib.pci_bus_id(o) for o in ordinals} | {p["pci"] for p in peers.values()}) == 1


def _export_pool(lib, device: jax.Device) -> tuple[int, int, int]:
    """(fd, base, size) of `device`'s XLA pool; checks that later arrays land in it."""
    probe = jax.device_put(np.zeros(1 << 12, np.uint8), device)
    later = jax.device_put(np.zeros(1 << 20, np.uint8), device)
    jax.block_until_ready((probe, later))
    fd, base, size = lib.export_pool(device.local_hardware_id, probe.unsafe_buffer_pointer())
    if not base <= later.unsafe_buffer_pointer() < base + size:
        os.close(fd)
        raise RuntimeError(
            f"`moonep_jax.bootstrap`: XLA's arrays on {device} do not share one memory pool (a "
            f"1 MiB array lies outside the {size} bytes around the first), so peers cannot map "
            "it once. Use XLA's default allocator with preallocation (unset "
            "XLA_PYTHON_CLIENT_ALLOCATOR and XLA_PYTHON_CLIENT_PREALLOCATE).")
    return fd, base, size


def _allow_peers_to_take_fds(allow: bool) -> None:
    """Under Yama's ptrace_scope 1 only an ancestor may `pidfd_getfd` from this process; allow
    any process of this user while bootstrapping (PR_SET_PTRACER), and revoke it after."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY if allow else 0), 0, 0, 0)


def _take_fd(pid: int, fd: int, device: jax.Device) -> int:
    """A descriptor of this process for descriptor `fd` of process `pid` (pidfd_getfd)."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as e:
        raise RuntimeError(f"`moonep_jax.bootstrap`: cannot open process {pid} (JAX device "
                           f"{device.id}'s process) to take its pool's descriptor: {e}. All "
                           "processes of an EP group must run on one host.") from e
    try:
        got = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise RuntimeError(
                f"`moonep_jax.bootstrap`: pidfd_getfd of process {pid}'s descriptor {fd} failed: "
                f"{os.strerror(err)}. It needs ptrace permission over the peer (same user; "
                "kernel.yama.ptrace_scope <= 1, or CAP_SYS_PTRACE).")
        return got
    finally:
        os.close(pidfd)


# ---- meshes -------------------------------------------------------------------------------------

def _rows(mesh: jax.sharding.Mesh, axis_name: str) -> np.ndarray:
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"`moonep_jax.bootstrap`: `mesh` must be a concrete jax.sharding.Mesh; got "
            f"{type(mesh).__name__}.")
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"`moonep_jax.bootstrap`: the mesh has no axis `{axis_name}` (`EPConfig.axis_name`); "
            f"its axes are {mesh.axis_names}.")
    ep = mesh.axis_names.index(axis_name)
    return np.moveaxis(mesh.devices, ep, -1).reshape(-1, mesh.devices.shape[ep])


def _shape_of(mesh) -> tuple:
    return tuple(zip(mesh.axis_names, mesh.devices.shape))
