"""Flax NNX layers whose weights are split over a mesh axis (FSDP)."""

from __future__ import annotations

import jax

from jax_qtrain.nn.linear import Linear
from jax_qtrain.recipes import Recipe

from .config import WeightSharding
from .sharded_dense import dense as sharded_dense

_UNSUPPORTED_LINEAR_OPTIONS = ("quantized_weight", "keep_master_weight", "quantized_weight_usages")


def _kernel_metadata(sharding: WeightSharding, metadata, ndim: int = 2) -> dict:
    """The kernel param's metadata: NNX places it on the mesh, split as `sharding` says, and
    `nnx.get_partition_spec` reports that layout."""
    metadata = dict(metadata or {})
    spec = tuple(sharding.kernel_spec(ndim))
    given = metadata.get("out_sharding")
    if given is not None and tuple(given) != spec:
        raise ValueError(
            f"kernel_metadata['out_sharding']={given!r} contradicts sharding, which splits the "
            f"kernel as {spec}"
        )
    metadata.update(out_sharding=spec, mesh=sharding.mesh)
    return metadata


class ShardedLinear(Linear):
    """`jax_qtrain.nn.Linear` with its kernel split over `sharding.axis` (FSDP).

    The kernel param is created on `sharding.mesh`, split along `sharding.kernel_dim`; the bias
    is replicated on the mesh. A call gathers the kernel with `sharding.strategy`, computes on
    each device's batch rows (the input's leading dim is split over `sharding.batch_axes`),
    re-gathers in backward and reduce-scatters the kernel gradient
    (`jax_qtrain.sharding.dense`). Call it under `jax.jit`/`nnx.jit`.

    Args:
      in_features, out_features, recipe, save_original_input, and `nnx.Linear`'s keyword
        arguments: as `jax_qtrain.nn.Linear`.
      sharding: a `WeightSharding`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        sharding: WeightSharding,
        recipe: Recipe | None = None,
        save_original_input: bool = False,
        **kwargs,
    ):
        if not isinstance(sharding, WeightSharding):
            raise TypeError(f"sharding must be a WeightSharding, got {type(sharding).__name__}")
        split_name, split_size = (
            ("in_features", in_features)
            if sharding.kernel_dim == 0
            else ("out_features", out_features)
        )
        if split_size % sharding.axis_size:
            raise ValueError(
                f"{split_name} {split_size} must be a multiple of {sharding.axis_size}, the size "
                f"of mesh axis {sharding.axis!r} it is split over"
            )
        for option in _UNSUPPORTED_LINEAR_OPTIONS:
            if option in kwargs:
                raise ValueError(
                    f"{option}: ShardedLinear quantizes the gathered kernel in every call; a "
                    "kept quantized weight is not supported with a split kernel"
                )
        kwargs["kernel_metadata"] = _kernel_metadata(sharding, kwargs.get("kernel_metadata"))
        # The bias is replicated on the mesh (in a multi-process run, a global array too).
        kwargs["bias_metadata"] = {
            "out_sharding": (None,),
            "mesh": sharding.mesh,
            **dict(kwargs.get("bias_metadata") or {}),
        }
        super().__init__(
            in_features,
            out_features,
            recipe=recipe,
            save_original_input=save_original_input,
            **kwargs,
        )
        self.sharding = sharding

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        del out_sharding
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        y = sharded_dense(
            inputs,
            kernel,
            bias,
            sharding=self.sharding,
            recipe=self.recipe,
            save_original_input=self.save_original_input,
        )
        if self.preferred_element_type is not None:
            y = y.astype(self.preferred_element_type)
        return y
