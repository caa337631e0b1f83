"""A few training steps of a model with split weights (a dense layer and an MoE block), for
test_multiprocess.py.

Run as a script, it is one process of a `jax.distributed` job on localhost (CPU devices, gloo
collectives) and process 0 writes the losses and final parameters to an .npz file:

    python -m tests.jax_qtrain.multiprocess_worker PROCESS_ID NUM_PROCESSES PORT OUT.npz

Imported, `train(mesh)` runs the same steps in the current process (the test's reference).
"""

from __future__ import annotations

import os
import sys

STEPS = 3
TOKENS, FEATURES, EXPERTS = 128, 128, 4  # 4 devices: 32 tokens, 32 kernel rows, 1 expert


def _model_and_batches(mesh):
    """A dense layer and an MoE block with per-module recipes — the dense layer NVFP4, the
    experts MXFP8 — their kernels split over the mesh's one axis (the experts one per device);
    and an integer batch, the same in every process."""
    import numpy as np
    from flax import nnx

    import jax_qtrain as jq
    from jax_qtrain import sharding as jqs

    # deterministic: gradients summed in mesh order, the same bits on any process layout.
    linear_sharding = jqs.WeightSharding(mesh, "fsdp", deterministic=True)
    expert_sharding = jqs.WeightSharding(mesh, "fsdp", kernel_dim="experts", deterministic=True)

    class Model(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.dense = jqs.ShardedLinear(
                FEATURES,
                FEATURES,
                sharding=linear_sharding,
                recipe=jq.NVFP4BlockScaling(),
                rngs=rngs,
            )
            self.moe = jqs.ShardedMoE(
                FEATURES,
                FEATURES // 2,
                EXPERTS,
                top_k=2,
                sharding=expert_sharding,
                recipe=jq.MXFP8BlockScaling(),
                rngs=rngs,
            )

        def __call__(self, x):
            return self.moe(self.dense(x), return_aux_loss=True)

    rng = np.random.default_rng(0)
    x = rng.integers(-8, 9, (TOKENS, FEATURES)).astype(np.float32)
    target = rng.integers(-8, 9, (TOKENS, FEATURES)).astype(np.float32)
    batches = [(x, target)] * STEPS  # one batch, fitted a little more in every step
    return Model(), batches, linear_sharding


def train(mesh) -> dict[str, object]:
    """STEPS SGD steps; returns {"losses": (STEPS,), "<param path>": array} as NumPy arrays."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.experimental import multihost_utils

    from tests.jax_qtrain.sharding_helpers import replicate_uncommitted

    model, batches, sharding = _model_and_batches(mesh)
    optimizer = nnx.Optimizer(model, optax.sgd(2.0**-10), wrt=nnx.Param)
    replicate_uncommitted((model, optimizer), mesh)
    batch_sharding = jax.sharding.NamedSharding(mesh, sharding.batch_spec())

    @nnx.jit
    def step(model, optimizer, x, target):
        def loss_fn(model):
            y, aux_loss = model(x)
            return jnp.mean((y - target) ** 2) + aux_loss

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def global_batch(array):
        return jax.make_array_from_callback(array.shape, batch_sharding, lambda i: array[i])

    losses = []
    for x, target in batches:
        loss = step(model, optimizer, global_batch(x), global_batch(target))
        losses.append(np.asarray(multihost_utils.process_allgather(loss, tiled=True)))
    out: dict[str, object] = {"losses": np.stack(losses)}
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = param.get_value()
        out["/".join(map(str, path))] = np.asarray(
            multihost_utils.process_allgather(value, tiled=True)
        )
    return out


def main(argv: list[str]) -> int:
    process_id, num_processes, port, out_path = int(argv[0]), int(argv[1]), argv[2], argv[3]
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}",
        num_processes=num_processes,
        process_id=process_id,
    )
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    result = train(mesh)
    if process_id == 0:
        np.savez(out_path, process_count=jax.process_count(), **result)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
