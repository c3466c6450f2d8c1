"""The one module that touches jax.distributed's key-value store (a private JAX API).

The CUDA transport's bootstrap passes small blobs between the processes of a job (pool handles,
base addresses, host ids) and the launcher waits at a barrier; both go through these functions.
Every wait is bounded and a timeout names the key or barrier it waited for.
"""

from __future__ import annotations

import jax


def _client():
    try:
        from jax._src import distributed
    except ImportError as e:  # pragma: no cover - jax layout changed
        raise RuntimeError(f"moonep_jax: jax.distributed's key-value store is unavailable ({e}).")
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "moonep_jax: this needs `jax.distributed.initialize()` (several processes), which has "
            "not been called in this process.")
    return client


def is_multiprocess() -> bool:
    """Whether this process is one of several of a `jax.distributed` job."""
    return jax.process_count() > 1


def put(key: str, value: str) -> None:
    """Publishes `value` under `key` (each key is written once per job)."""
    _client().key_value_set(key, value)


def get(key: str, timeout_s: float, what: str) -> str:
    """The value another process published under `key`; raises TimeoutError naming `what`."""
    try:
        return _client().blocking_key_value_get(key, int(timeout_s * 1000))
    except Exception as e:  # the client raises XlaRuntimeError (DEADLINE_EXCEEDED) on timeout
        raise TimeoutError(
            f"moonep_jax: process {jax.process_index()} waited {timeout_s:.0f} s for {what} "
            f"(key {key!r}) and it never arrived: {e}") from e


def barrier(name: str, timeout_s: float, processes: list[int] | None = None) -> None:
    """`processes` (default: all processes of the job) meet here; raises TimeoutError naming
    the barrier. Every process of `processes` must pass the same list."""
    try:
        _client().wait_at_barrier(name, int(timeout_s * 1000), processes)
    except Exception as e:
        who = "every process" if processes is None else f"every one of processes {processes}"
        raise TimeoutError(
            f"moonep_jax: process {jax.process_index()} waited {timeout_s:.0f} s at barrier "
            f"{name!r} and not {who} arrived: {e}") from e
