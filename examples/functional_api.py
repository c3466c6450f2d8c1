import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # CPUs as 8 devices

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import moonep_jax

R = len(jax.devices())
cfg = moonep_jax.EPConfig(num_experts=4 * R, top_k=4, tokens_per_rank=128, hidden=64,
                          ffn_hidden=128, num_ranks=R, axis_name="ep")
S, K, E, H, F = (cfg.tokens_per_rank, cfg.top_k, cfg.num_experts, cfg.hidden, cfg.ffn_hidden)
mesh = Mesh(np.array(jax.devices()), ("ep",))
ep = NamedSharding(mesh, P("ep"))

k = jax.random.split(jax.random.key(0), 4)
x = jax.device_put(jax.random.normal(k[0], (R * S, H)), ep)
topk_idx, sigma, maxvio = moonep_jax.routing.lognormal_for_maxvio(k[1], R, S, K, E, target=4.0)
topk_idx = jax.device_put(topk_idx.reshape(R * S, K), ep)          # skewed router output
topk_w = jax.device_put(jax.nn.softmax(jax.random.normal(k[2], (R * S, K))), ep)
params = {"w_gate_up": jax.device_put(0.05 * jax.random.normal(k[3], (E, H, 2 * F)), ep),
          "w_down": jax.device_put(0.05 * jax.random.normal(k[3], (E, F, H)), ep)}


def per_rank(x, topk_idx, topk_w, params):  # shapes per rank: [S,H], [S,K], [S,K], [epn,...]
    plan = moonep_jax.plan(topk_idx, cfg)
    received = jnp.sum(plan.recv_src >= 0)[None]                     # real rows on this rank
    return moonep_jax.moe_ffn(x, topk_idx, topk_w, params, cfg), received


layer = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
out, received = layer(x, topk_idx, topk_w, params)
print(f"maxvio {maxvio:.2f}; slots received per rank: {received.tolist()}")  # all S*K

loss = lambda p: jnp.sum(layer(x, topk_idx, topk_w, p)[0] ** 2)
grads = jax.jit(jax.grad(loss))(params)   # complete per-expert gradients, sharded like params
print({name: g.shape for name, g in grads.items()})
