"""What every public op does before it computes: validate, type its inputs, pick its backend.

Validation runs at trace time, before the backend is chosen, so that the xla and cuda
implementations share every check. Messages follow one pattern: the op, the argument in backticks,
the rule with its symbols and numbers, then what was given, e.g.
"`moonep_jax.dispatch`: `x` must have shape [S, H] = [8, 16]; got [8, 4]."

`vary_together` makes the differentiable inputs of a `custom_vjp` vary over the same mesh axes, so
that a replicated input's cotangent is summed over those axes by JAX (the transpose of `pcast`),
neither dropped nor over-counted (jax_ffi_notes.md §11).

`implementation` is the single switch from a config to its implementation module (`moonep_jax._xla`
or `moonep_jax._cuda.ops`, the same function names in both).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import jax
import jax.numpy as jnp
from jax import lax

from moonep_jax._impl import resolved_implementation
from moonep_jax.config import EPConfig
from moonep_jax.plan_types import Plan

# ---- validation ---------------------------------------------------------------------------------


def check_config(op: str, cfg) -> None:
    if not isinstance(cfg, EPConfig):
        raise TypeError(f"`{op}`: `cfg` must be a moonep_jax.EPConfig; got {type(cfg).__name__}.")


def _shape_and_dtype(op: str, name: str, x, what: str):
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"`{op}`: `{name}` must be {what}; got {type(x).__name__}.")
    return list(shape), jnp.dtype(dtype)


def check_array(op: str, name: str, x, dims: str, shape: Sequence[int], dtype=None) -> None:
    """Checks that `x` is an array of `shape` (named `dims`, e.g. "[S, H]") and, if given, `dtype`.

    Raises:
      TypeError: `x` is not an array, or has the wrong dtype.
      ValueError: `x` has the wrong shape.
    """
    kind = "an array" if dtype is None else f"a {jnp.dtype(dtype).name} array"
    got_shape, got_dtype = _shape_and_dtype(op, name, x, f"{kind} of shape {dims}")
    if got_shape != list(shape):
        raise ValueError(
            f"`{op}`: `{name}` must have shape {dims} = {list(shape)}; got {got_shape}.")
    if dtype is not None and got_dtype != jnp.dtype(dtype):
        raise TypeError(f"`{op}`: `{name}` must have dtype {jnp.dtype(dtype).name}; "
                        f"got {got_dtype.name}.")


def check_floating(op: str, name: str, x) -> None:
    _, dtype = _shape_and_dtype(op, name, x, "a floating-point array")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"`{op}`: `{name}` must have a floating-point dtype; got {dtype.name}.")


def check_same_dtype(op: str, name: str, x, ref_name: str, ref) -> None:
    if jnp.dtype(x.dtype) != jnp.dtype(ref.dtype):
        raise TypeError(
            f"`{op}`: `{name}` must have the dtype of `{ref_name}` ({jnp.dtype(ref.dtype).name}); "
            f"got {jnp.dtype(x.dtype).name}.")


def check_plan(op: str, plan, cfg: EPConfig) -> None:
    """Checks that `plan` is a `Plan` whose int32 leaves have the shapes `cfg` implies."""
    if not isinstance(plan, Plan):
        raise TypeError(f"`{op}`: `plan` must be a moonep_jax.Plan (from `moonep_jax.plan`); "
                        f"got {type(plan).__name__}.")
    R, N, G, B, nvs = cfg.num_ranks, cfg.num_entries, cfg.num_groups, cfg.num_slots, cfg.nvs
    expected = {
        "dst": ("[N]", [N]),
        "cu_seqlens": ("[G]", [G]),
        "zero_fill": ("[G, 2]", [G, 2]),
        "experts_to_copy": ("[R, B]", [R, B]),
        "recv_src": ("[NvS]", [nvs]),
        "recv_primary": ("[NvS]", [nvs]),
        "num_invalid_ids": ("[1]", [1]),
    }
    for field, (dims, shape) in expected.items():
        check_array(op, f"plan.{field}", getattr(plan, field), dims, shape, jnp.int32)


def check_ep_axis(op: str, cfg: EPConfig) -> None:
    """Checks that the op is traced inside `shard_map` over `cfg.axis_name` of size R."""
    try:
        size = lax.axis_size(cfg.axis_name)
    except NameError:
        mesh_axes = jax.sharding.get_abstract_mesh().axis_names
        where = (f"the mesh here has axes {mesh_axes}" if mesh_axes
                 else "no mesh axis is bound here")
        raise ValueError(
            f"`{op}`: the EP axis `{cfg.axis_name}` (`EPConfig.axis_name`) is not bound ({where}); "
            "call it inside `jax.shard_map` over a mesh with that axis, or set "
            "`EPConfig.axis_name` to the mesh's EP axis.") from None
    if size != cfg.num_ranks:
        raise ValueError(
            f"`{op}`: the EP axis `{cfg.axis_name}` must have size `EPConfig.num_ranks` = "
            f"{cfg.num_ranks}; got {size}.")


def check_trainable(op: str, cfg: EPConfig) -> None:
    """Gradients need every remote expert in a slot; called from `custom_vjp` forward rules."""
    if not cfg.trainable:
        raise ValueError(
            f"`{op}`: gradients need prefetch_slots == epn (= {cfg.epn}); got prefetch_slots = "
            f"{cfg.num_slots}. With B < epn, overflow experts are computed on ranks that do not "
            "own them, so their weight gradients have no home; use B < epn for inference only.")


# ---- typing -------------------------------------------------------------------------------------


def _varying_axes(x) -> frozenset:
    return jax.typeof(x).manual_axis_type.varying


def vary_together(arrays: Sequence[jax.Array], axis_name: str) -> list[jax.Array]:
    """Makes every array vary over the union of their varying mesh axes and `axis_name`.

    Without `check_vma` no array carries varying axes and this only adds `axis_name`, which is a
    no-op there.
    """
    union = frozenset({axis_name}).union(*(_varying_axes(a) for a in arrays))
    out = []
    for a in arrays:
        missing = tuple(sorted(union - _varying_axes(a)))
        out.append(lax.pcast(a, missing, to="varying") if missing else a)
    return out


def zeros_varying_like(shape, dtype, like: jax.Array) -> jax.Array:
    """Zeros that vary over the mesh axes `like` varies over (a loop carry must keep its type)."""
    axes = tuple(sorted(_varying_axes(like)))
    zeros = jnp.zeros(shape, dtype)
    return lax.pcast(zeros, axes, to="varying") if axes else zeros


# ---- implementation choice ----------------------------------------------------------------------


def implementation(cfg: EPConfig) -> ModuleType:
    """The module of `cfg`'s resolved implementation, `moonep_jax._xla` or `moonep_jax._cuda.ops`:
    both define the backend functions of docs/CONTRACT.md under the same names (`dispatch`,
    `grouped_matmul_dw`, ...). Imported here, on first use: the xla functions live in the op
    modules, which import this one, and the CUDA ones need only be importable where they run."""
    if resolved_implementation(cfg) == "cuda":
        from moonep_jax._cuda import ops

        return ops
    from moonep_jax import _xla

    return _xla
