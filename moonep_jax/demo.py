"""`python -m moonep_jax demo`: train a tiny MoE transformer language model with MoonEP layers.

A byte-level, 2-layer transformer (causal attention + `moonep_jax.flax.MoE` FFN) learns the short
text in `moonep_jax/data/corpus.txt` with optax AdamW under `jax.jit`, data- and expert-parallel
over every device of the job (8 simulated CPU devices when there is no accelerator; with
`--processes N`, N local processes of one `jax.distributed` job, see `moonep_jax.__main__`). The
progress line
shows the loss, the router's skew (maxvio) and the slots each EP rank received: they are all equal,
whatever the skew, which is MoonEP's invariant.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import io
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import moonep_jax
from moonep_jax import _ffi
from moonep_jax.flax import MoE

VOCAB = 256  # bytes


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Sizes of the demo model and run; `batch` and `num_experts` are multiples of the devices."""

    steps: int = 100
    seed: int = 0
    seq_len: int = 64
    batch: int = 16
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    num_experts: int = 16
    top_k: int = 2
    ffn_hidden: int = 64
    shared_ffn_hidden: int = 64
    learning_rate: float = 3e-3
    log_every: int = 10  # steps per progress line when the output is not a terminal


def load_corpus() -> np.ndarray:
    """The shipped corpus as `[n] uint8` bytes."""
    text = importlib.resources.files("moonep_jax.data").joinpath("corpus.txt").read_bytes()
    return np.frombuffer(text, dtype=np.uint8)


def sample_batch(corpus: np.ndarray, rng: np.random.Generator, batch: int,
                 seq_len: int) -> np.ndarray:
    """`[batch, seq_len + 1] int32` random windows of the corpus (inputs and shifted targets)."""
    starts = rng.integers(0, corpus.size - seq_len - 1, size=batch)
    return np.stack([corpus[s:s + seq_len + 1] for s in starts]).astype(np.int32)


class Attention(nnx.Module):
    """Multi-head causal self-attention."""

    def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
        self.num_heads = num_heads
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq_len, d_model = x.shape
        qkv = self.qkv(x).reshape(batch, seq_len, 3, self.num_heads, d_model // self.num_heads)
        y = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
        return self.out(y.reshape(batch, seq_len, d_model))


class Block(nnx.Module):
    """Pre-norm transformer block whose FFN is a MoonEP MoE layer."""

    def __init__(self, cfg: DemoConfig, mesh: jax.sharding.Mesh, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.attn = Attention(cfg.d_model, cfg.num_heads, rngs=rngs)
        self.ffn_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.moe = MoE(cfg.d_model, cfg.ffn_hidden, cfg.num_experts, cfg.top_k, mesh=mesh,
                       rngs=rngs, shared_ffn_hidden=cfg.shared_ffn_hidden)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict]:
        x = x + self.attn(self.attn_norm(x))
        batch, seq_len, d_model = x.shape
        # The MoE layer takes a flat token list; tokens stay sharded by batch row.
        y, aux = self.moe(self.ffn_norm(x).reshape(batch * seq_len, d_model))
        return x + y.reshape(batch, seq_len, d_model), aux


class TinyMoELM(nnx.Module):
    """Byte-level transformer LM: embeddings, `num_layers` MoE blocks, untied output head."""

    def __init__(self, cfg: DemoConfig, mesh: jax.sharding.Mesh, *, rngs: nnx.Rngs):
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, cfg.d_model)))
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.seq_len, cfg.d_model)))
        self.blocks = nnx.List([Block(cfg, mesh, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, list[dict]]:
        # A one-hot matmul instead of a gather: its sharding follows the batch under Explicit axes.
        x = jax.nn.one_hot(tokens, VOCAB, dtype=jnp.float32) @ self.embed[...] + self.pos[...][None]
        auxes = []
        for block in self.blocks:
            x, aux = block(x)
            auxes.append(aux)
        return self.head(self.norm(x)), auxes


def scaled_config(cfg: DemoConfig, num_devices: int) -> DemoConfig:
    """Rounds `batch` and `num_experts` up to multiples of the device count."""
    def round_up(n):
        return -(-n // num_devices) * num_devices
    return dataclasses.replace(cfg, batch=round_up(cfg.batch),
                               num_experts=round_up(cfg.num_experts))


def init_model(cfg: DemoConfig, mesh: jax.sharding.Mesh):
    """`(graphdef, params, rest)` of a fresh model, every array placed on `mesh`.

    Initialised in one jitted program: run eagerly, every initialiser would compile on its own.
    """
    def create():
        model = TinyMoELM(cfg, mesh, rngs=nnx.Rngs(cfg.seed))
        return nnx.split(model, nnx.Param, ...)

    with jax.set_mesh(mesh):  # unannotated variables are replicated over the mesh
        return nnx.jit(create)()


def make_train_step(graphdef, tx):
    """The jitted step: (params, rest, opt_state, batch) -> (params, opt_state, loss, auxes)."""

    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        logits, auxes = model(batch[:, :-1])
        # One-hot labels rather than a gather: its transpose needs no scatter sharding rule.
        labels = jax.nn.one_hot(batch[:, 1:], VOCAB, dtype=logits.dtype)
        loss = optax.softmax_cross_entropy(logits, labels).mean()
        return loss, auxes

    @jax.jit
    def train_step(params, rest, opt_state, batch):
        (loss, auxes), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, auxes

    return train_step


def progress_line(step: int, steps: int, loss: float, auxes: list[dict],
                  tokens_per_s: float) -> str:
    """One status line: step, loss, per-layer maxvio and per-rank received slots, throughput."""
    maxvio = "/".join(f"{float(a['maxvio']):.2f}" for a in auxes)
    recv = " ".join(str(int(n)) for n in auxes[0]["recv_slots"])
    speed = f"{tokens_per_s:,.0f} tok/s" if tokens_per_s else "(first step: compiled)"
    return (f"step {step:>{len(str(steps))}}/{steps}  loss {loss:.3f}  maxvio {maxvio}  "
            f"recv/rank [{recv}]  {speed}")


def global_batch(batch: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The same host batch in every process, placed as one global array."""
    return jax.make_array_from_callback(batch.shape, sharding, lambda index: batch[index])


def to_host(x: jax.Array) -> np.ndarray:
    """A global array on the host of every process (sharded ones gathered across processes)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x.addressable_data(0) if x.is_fully_replicated else x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class Progress:
    """The progress line: redrawn in place with `\\r` on a terminal; elsewhere (a log file, a
    pipe) one full line for the first step, every `every`-th step and the last, so that a log
    reads as lines instead of one run-on line of redraws."""

    def __init__(self, out, steps: int, every: int):
        isatty = getattr(out, "isatty", None)
        self.out, self.steps, self.every = out, steps, max(1, every)
        self.on_terminal = bool(isatty and isatty())

    def update(self, step: int, line: str) -> None:
        if self.on_terminal:
            print("\r" + line, end="", file=self.out, flush=True)
        elif step == 1 or step % self.every == 0 or step == self.steps:
            print(line, file=self.out, flush=True)

    def close(self) -> None:
        if self.on_terminal:
            print(file=self.out)  # ends the redrawn line


def run(cfg: DemoConfig, out=None) -> dict:
    """Trains the demo model, printing to `out` (default stdout); returns a summary dict.

    The progress line shows the first layer's received slots per rank; the summary checks them
    over every layer and step.
    """
    out = sys.stdout if out is None else out
    if jax.process_index() != 0:
        out = io.StringIO()  # one process reports for the job
    devices = jax.devices()
    cfg = scaled_config(cfg, len(devices))
    mesh = jax.make_mesh((len(devices),), ("ep",), axis_types=(AxisType.Explicit,), devices=devices)
    if jax.default_backend() == "gpu" and _ffi.available():
        moonep_jax.bootstrap(mesh, "ep")  # before anything is traced
    graphdef, params, rest = init_model(cfg, mesh)
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, max(1, cfg.steps // 10), max(cfg.steps, 2)), weight_decay=0.01)
    opt_state = tx.init(params)
    train_step = make_train_step(graphdef, tx)

    corpus, rng = load_corpus(), np.random.default_rng(cfg.seed)
    batch_sharding = NamedSharding(mesh, P("ep", None))
    tokens_per_step = cfg.batch * cfg.seq_len
    losses, slot_counts = [], set()
    start = time.perf_counter()
    compile_s = 0.0
    tokens_per_s = 0.0
    progress = Progress(out, cfg.steps, cfg.log_every)
    for step in range(1, cfg.steps + 1):
        batch = global_batch(sample_batch(corpus, rng, cfg.batch, cfg.seq_len), batch_sharding)
        params, opt_state, loss, auxes = train_step(params, rest, opt_state, batch)
        losses.append(float(loss))  # waits for the step: the line reports finished work
        auxes = [jax.tree.map(to_host, aux) for aux in auxes]
        for aux in auxes:
            slot_counts.update(int(n) for n in aux["recv_slots"])
        if step == 1:
            compile_s = time.perf_counter() - start
            start = time.perf_counter()
        else:
            tokens_per_s = tokens_per_step * (step - 1) / (time.perf_counter() - start)
        progress.update(step, progress_line(step, cfg.steps, losses[-1], auxes, tokens_per_s))
    progress.close()

    summary = {"steps": cfg.steps, "devices": len(devices), "platform": devices[0].platform,
               "processes": jax.process_count(),
               "first_loss": losses[0], "final_loss": losses[-1], "losses": losses,
               "slots_per_rank": sorted(slot_counts), "tokens_per_s": tokens_per_s,
               "compile_s": compile_s, "maxvio": [float(a["maxvio"]) for a in auxes]}
    print_summary(summary, cfg, out)
    return summary


def print_summary(summary: dict, cfg: DemoConfig, out) -> None:
    balanced = len(summary["slots_per_rank"]) == 1
    slots = summary["slots_per_rank"]
    processes = summary.get("processes", 1)
    where = f" in {processes} processes" if processes > 1 else ""
    print(f"trained {cfg.num_layers}-layer MoE LM (E={cfg.num_experts}, K={cfg.top_k}) for "
          f"{summary['steps']} steps on {summary['devices']} {summary['platform']} devices"
          f"{where} (EP={summary['devices']})", file=out)
    print(f"  loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}", file=out)
    print(f"  final router maxvio per layer: "
          + ", ".join(f"{m:.2f}" for m in summary["maxvio"]), file=out)
    if balanced:
        print(f"  every rank received exactly {slots[0]} slots (S*K) in every layer and step",
              file=out)
    else:
        print(f"  received slots per rank varied: {slots}", file=out)
    print(f"  {summary['tokens_per_s']:,.0f} tokens/s after a {summary['compile_s']:.1f} s first "
          f"step (compilation)", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moonep_jax demo",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=DemoConfig.steps, help="training steps")
    parser.add_argument("--seed", type=int, default=DemoConfig.seed, help="init and data seed")
    parser.add_argument("--processes", type=int, default=1,
                        help="local processes of one jax.distributed job (python -m moonep_jax)")
    parser.add_argument("--log-every", type=int, default=DemoConfig.log_every,
                        help="steps per progress line when stdout is not a terminal")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1; got {args.steps}")
    if args.log_every < 1:
        parser.error(f"--log-every must be >= 1; got {args.log_every}")
    run(DemoConfig(steps=args.steps, seed=args.seed, log_every=args.log_every))
    return 0
