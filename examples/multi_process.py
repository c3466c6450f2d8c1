"""One process of a multi-process EP job (README "Several processes, several hosts").

    python examples/multi_process.py COORDINATOR NUM_PROCESSES PROCESS_ID [EP]

Every process calls `jax.distributed.initialize`, builds the same global ("data", "ep") mesh
(EP consecutive devices per EP group, default: one process's devices; the data axis across
the rest), bootstraps the CUDA transport before tracing, and runs a training step of
`moe_ffn`: XLA's own collectives for the data axis, moonep_jax's transport for EP. On CPU
(JAX_PLATFORMS=cpu) each process simulates 4 devices and XLA's collectives use gloo; on GPUs
each process drives one GPU of its host, $SLURM_LOCALID or $LOCAL_RANK if set, else PROCESS_ID
(all GPUs stay visible, so that the transport can map its peers' memory).
"""

import os
import sys

coordinator, num_processes, process_id = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
on_cpu = os.environ.get("JAX_PLATFORMS") == "cpu"
if on_cpu:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import moonep_jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
local_gpu = int(os.environ.get("SLURM_LOCALID", os.environ.get("LOCAL_RANK", process_id)))
jax.distributed.initialize(coordinator, num_processes, process_id,
                           local_device_ids=None if on_cpu else [local_gpu])
EP = int(sys.argv[4]) if len(sys.argv) > 4 else jax.local_device_count()
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))  # a host's processes
mesh = Mesh(np.array(devices).reshape(-1, EP), ("data", "ep"))       # are consecutive
if jax.default_backend() == "gpu":
    moonep_jax.bootstrap(mesh, "ep")  # every process, after building the mesh, before tracing

D = mesh.shape["data"]
cfg = moonep_jax.EPConfig(num_experts=4 * EP, top_k=2, tokens_per_rank=32, hidden=64,
                          ffn_hidden=64, num_ranks=EP, axis_name="ep")
S, K, E, H, F = (cfg.tokens_per_rank, cfg.top_k, cfg.num_experts, cfg.hidden, cfg.ffn_hidden)
tokens, experts = P(("data", "ep")), P("ep")  # tokens over both axes; experts over EP only


def global_array(spec, value):  # the same host value in every process, placed as one array
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


rng = np.random.default_rng(0)  # same seed everywhere: every process builds the same inputs
x = global_array(tokens, rng.standard_normal((D * EP * S, H)).astype(np.float32))
idx, _, maxvio = moonep_jax.routing.lognormal_for_maxvio(jax.random.key(0), D * EP, S, K, E, 4.0)
topk_idx = global_array(tokens, np.asarray(idx).reshape(D * EP * S, K))
topk_w = global_array(tokens, rng.random((D * EP * S, K)).astype(np.float32))
params = {"w_gate_up": global_array(experts, 0.05 * rng.standard_normal((E, H, 2 * F), np.float32)),
          "w_down": global_array(experts, 0.05 * rng.standard_normal((E, F, H), np.float32))}


def per_rank(x, topk_idx, topk_w, params):
    received = jnp.sum(moonep_jax.plan(topk_idx, cfg).recv_src >= 0)[None]
    out = moonep_jax.moe_ffn(x.astype(jnp.bfloat16), topk_idx, topk_w,
                             jax.tree.map(lambda w: w.astype(jnp.bfloat16), params), cfg)
    return out.astype(jnp.float32), received


layer = jax.shard_map(per_rank, mesh=mesh, in_specs=(tokens, tokens, tokens, experts),
                      out_specs=(tokens, tokens))


@jax.jit
def step(params, x, topk_idx, topk_w):  # expert gradients: summed over "data" by XLA's
    def loss(p):                          # collectives, reduced over "ep" by moonep_jax
        out, received = layer(x, topk_idx, topk_w, p)
        return jnp.mean(out ** 2), received

    (value, received), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), received


loss, params, received = step(params, x, topk_idx, topk_w)
slots = sorted({int(n) for shard in received.addressable_shards for n in np.asarray(shard.data)})
# One write of the whole line: the processes of a job often share a terminal, and print() writes
# the text and its newline separately, so two processes' reports could run into one line.
sys.stdout.write(f"process {jax.process_index()}/{jax.process_count()}: mesh {dict(mesh.shape)}, "
                 f"maxvio {float(maxvio):.2f}, loss {float(loss):.6f}, slots received per local "
                 f"rank {slots}\n")
sys.stdout.flush()
moonep_jax.check_transport_errors()
