"""Static configuration of one expert-parallel MoE layer.

`EPConfig` holds every static size the MoonEP plan and kernels depend on. It is a frozen, hashable
dataclass, so it can be closed over by `jax.jit` and passed as a `nondiff_argnums` argument of a
`jax.custom_vjp`. Invalid configurations fail when the config is built, with a message that names
the argument and the rule.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Literal

Implementation = Literal["auto", "cuda", "xla"]
IMPLEMENTATIONS = ("auto", "cuda", "xla")

# MAX_TOP_K and DROPPED have C++ copies in kernels/constants.h (the package must run without the
# extension, so it cannot read them from there); tests/test_constants.py holds the two equal.
MAX_TOP_K = 32

# Sentinel written in `Plan.dst` for an entry whose expert id is -1 (dropped: no slot, no payload).
# Duplicates are encoded as -(dest*NvS + row) - 1 >= -R*NvS > DROPPED, so the encodings never meet.
DROPPED = -(2**31)


@dataclasses.dataclass(frozen=True)
class CudaOptions:
    """Tuning knobs of the CUDA path. They never change results.

    Args:
      num_sms: CTAs of the communication kernels (dispatch, combine, prefetch, reduce_grad);
        None (the default): one per SM of the device. XLA runs these kernels alone on its stream,
        so every SM would otherwise idle (32 CTAs made dispatch and combine 1.7-2.4x slower on
        an H200); a smaller number leaves SMs to work that runs concurrently.
      timeout_s: upper bound of every cross-GPU wait. A wait that expires reports the EP rank, the
        epoch and what it waited for, instead of hanging the GPU.
      combine_on_owner: whether combine's first stage (a token's rows on one rank summed, in k
        order) runs on the rank that holds the rows, which then sends one row per (token, rank)
        to the token's home; False: the home reads every row in place. None (the default): True
        when the EP ranks are different GPUs (fewest bytes over NVLink), False when they all
        share one GPU (processes under MPS: the peers' rows are in the same HBM, and reading them
        in place moves the fewest bytes). Both give bitwise the same result.
    """

    num_sms: int | None = None
    timeout_s: float = 10.0
    combine_on_owner: bool | None = None

    def __post_init__(self):
        if self.num_sms is not None and (isinstance(self.num_sms, bool)
                                         or not isinstance(self.num_sms, int)
                                         or not 1 <= self.num_sms <= 1024):
            raise ValueError("`CudaOptions.num_sms` must be None (one CTA per SM) or an int in "
                             f"[1, 1024]; got {self.num_sms!r}.")
        if not self.timeout_s > 0:
            raise ValueError(f"`CudaOptions.timeout_s` must be > 0 seconds; got {self.timeout_s!r}.")
        if self.combine_on_owner is not None and not isinstance(self.combine_on_owner, bool):
            raise ValueError("`CudaOptions.combine_on_owner` must be None (decided by the devices), "
                             f"True or False; got {self.combine_on_owner!r}.")


def _as_int(name: str, value, lo: int = 1) -> int:
    """`value` as a Python int; any integer type (`np.int64` from array shapes too), never bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`EPConfig.{name}` must be an int; got {type(value).__name__} {value!r}.")
    if value < lo:
        raise ValueError(f"`EPConfig.{name}` must be >= {lo}; got {value}.")
    return int(value)


@dataclasses.dataclass(frozen=True)
class EPConfig:
    """Sizes of one MoonEP expert-parallel layer; all shapes are per EP rank.

    Args:
      num_experts: E, routed experts. `E % R == 0`; expert `e` lives on rank `e // epn`.
      top_k: K, experts per token, `1 <= K <= 32`.
      tokens_per_rank: S, tokens per rank (static).
      hidden: H, model hidden size.
      ffn_hidden: F, expert FFN intermediate size.
      num_ranks: R, size of the EP mesh axis.
      prefetch_slots: B, replica slots per rank, `1 <= B <= epn`; None means `epn`. Training
        (taking gradients) requires `B == epn`; inference allows `B < epn`, in which case remote
        experts beyond the top B are read in place from their home rank ("overflow").
      token_padding: tp, every non-empty group is padded to a multiple of tp rows.
      axis_name: the EP mesh axis the ops run under (inside `jax.shard_map`).
      implementation: "xla" (pure JAX reference), "cuda" (XLA FFI kernels) or "auto" (cuda when the
        extension is built and the platform is a GPU, else xla).
      cuda: tuning knobs of the CUDA path (`CudaOptions`).
      check_expert_ids: opt-in run-time check of the routing. Expert ids outside `[-1, E)` are
        always dropped like -1 and counted in `Plan.num_invalid_ids` (the modules' `aux`); with
        True, `moonep_jax.plan` (and so `moe_ffn`) also adds a `jax.experimental.checkify` check
        that fails when the count is not zero. Wrap the step in `checkify.checkify` and call
        `.throw()` on the error it returns to get a Python error naming the EP rank and the
        count; without `checkify.checkify`, tracing it under `jax.jit` raises.
    """

    num_experts: int
    top_k: int
    tokens_per_rank: int
    hidden: int
    ffn_hidden: int
    num_ranks: int
    prefetch_slots: int | None = None
    token_padding: int = 1
    axis_name: str = "ep"
    implementation: Implementation = "auto"
    cuda: CudaOptions = CudaOptions()
    check_expert_ids: bool = False

    def __post_init__(self):
        # Sizes are stored as Python ints, so that equal configs hash and print alike whatever
        # integer type they were given in.
        for name in ("num_experts", "top_k", "tokens_per_rank", "hidden", "ffn_hidden",
                     "num_ranks", "token_padding"):
            object.__setattr__(self, name, _as_int(name, getattr(self, name)))
        E, R = self.num_experts, self.num_ranks
        if E % R:
            raise ValueError(
                f"`EPConfig.num_experts` must be divisible by `num_ranks` (E % R == 0); "
                f"got E={E}, R={R}.")
        if self.top_k > MAX_TOP_K:
            raise ValueError(f"`EPConfig.top_k` must satisfy K <= {MAX_TOP_K}; got K={self.top_k}.")
        if self.prefetch_slots is not None:
            object.__setattr__(self, "prefetch_slots",
                               _as_int("prefetch_slots", self.prefetch_slots))
            if self.prefetch_slots > self.epn:
                raise ValueError(
                    f"`EPConfig.prefetch_slots` must satisfy 1 <= B <= epn = E/R = {self.epn}; "
                    f"got B={self.prefetch_slots}.")
        if not isinstance(self.axis_name, str) or not self.axis_name:
            raise TypeError(f"`EPConfig.axis_name` must be a non-empty str; got {self.axis_name!r}.")
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"`EPConfig.implementation` must be one of {IMPLEMENTATIONS}; "
                f"got {self.implementation!r}.")
        if not isinstance(self.check_expert_ids, bool):
            got = self.check_expert_ids
            raise TypeError(f"`EPConfig.check_expert_ids` must be a bool; "
                            f"got {type(got).__name__} {got!r}.")
        if not isinstance(self.cuda, CudaOptions):
            raise TypeError(f"`EPConfig.cuda` must be a CudaOptions; got {type(self.cuda).__name__}.")
        if self.num_ranks * self.nvs >= 2**31:
            raise ValueError(
                f"`EPConfig`: R*NvS must fit in int32 (R*NvS < 2**31); got R={R}, NvS={self.nvs}.")

    # ---- derived sizes ------------------------------------------------------------------------

    @property
    def epn(self) -> int:
        """Experts per rank, E / R."""
        return self.num_experts // self.num_ranks

    @property
    def num_slots(self) -> int:
        """B, replica slots per rank."""
        return self.epn if self.prefetch_slots is None else self.prefetch_slots

    @property
    def num_entries(self) -> int:
        """N = S*K routed entries per rank."""
        return self.tokens_per_rank * self.top_k

    @property
    def num_groups(self) -> int:
        """G = E + B weight rows (groups) seen by the grouped GEMM."""
        return self.num_experts + self.num_slots

    @property
    def nvs(self) -> int:
        """NvS, static receive rows per rank: S*K + (tp-1)*min(2*epn, G), rounded up to tp."""
        tp = self.token_padding
        rows = self.num_entries + (tp - 1) * min(2 * self.epn, self.num_groups)
        return -(-rows // tp) * tp

    @property
    def replicas_possible(self) -> bool:
        """Whether a plan can use a replica slot: only with another rank's experts to copy (R > 1).
        With R = 1 every slot is unused by construction, so moe_ffn neither fills slots nor
        reduces their gradients."""
        return self.num_ranks > 1

    @property
    def trainable(self) -> bool:
        """Gradients can be taken only when every remote expert gets a slot (B == epn)."""
        return self.num_slots == self.epn
