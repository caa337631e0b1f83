"""Flax NNX layers whose weights are split over a mesh axis (FSDP): `ShardedLinear` and
`ShardedMoE`."""

from __future__ import annotations

import math
from collections.abc import Iterable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from jax import lax
from jax.sharding import PartitionSpec

from jax_qtrain.nn.grouped import default_expert_kernel_init, keep_quantized, refresh_mlp_kernels
from jax_qtrain.nn.linear import Linear
from jax_qtrain.nn.moe import (
    combine_slots,
    default_router_init,
    dispatch_tokens,
    expert_counts,
    permute_by_expert,
    permute_rows,
    route_top_k,
)
from jax_qtrain.ops.activations import check_activation, is_gated
from jax_qtrain.quantize import Usage
from jax_qtrain.recipes import Recipe, check_recipe

from .config import WeightSharding, check_kernel_dim, laid_out
from .expert_parallel import expert_parallel_mlp
from .kept_weight import SplitKernelLayout
from .reductions import psum, replicated_input
from .sharded_dense import dense as sharded_dense
from .sharded_grouped import fsdp_grouped_mlp

_NN = (((1,), (0,)), ((), ()))


def _latest(previous, new):  # sown intermediates hold the latest call's value (as nn.MoE)
    del previous
    return new


def _nothing():
    return None


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

    With `quantized_weight=True` (and `keep_master_weight`, `quantized_weight_usages`, as
    `jax_qtrain.nn.Linear`) the layer keeps its kernel's quantized copies split like the kernel
    (`SplitKernelLayout`; strategy "quantize_then_gather"): a call gathers the kept fprop copy's
    bytes instead of quantizing, backward re-gathers the kept dgrad copy, and
    `jax_qtrain.nn.Optimizer` (or `refresh_quantized_weights`) re-quantizes the shards after
    each update. The kept copies equal the whole kernel's quantization bit for bit.

    Args:
      in_features, out_features, recipe, save_original_input, quantized_weight,
        keep_master_weight, quantized_weight_usages, and `nnx.Linear`'s keyword arguments: as
        `jax_qtrain.nn.Linear`.
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
        check_kernel_dim(sharding.kernel_dim)  # "experts" splits grouped layers only
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
        self.sharding = sharding  # before Linear.__init__, which may keep a split weight
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

    def _kept_weight_layout(self) -> SplitKernelLayout:
        return SplitKernelLayout(self.sharding)

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        del out_sharding
        if self.quantized_kernel is not None:
            inputs, kernel, bias, quantized = self._kept_weight_operands(inputs)
        else:
            quantized = None
            bias = self.bias[...] if self.bias is not None else None
            kernel = self.kernel[...]
            inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        y = sharded_dense(
            inputs,
            kernel,
            bias,
            sharding=self.sharding,
            recipe=self.recipe,
            save_original_input=self.save_original_input,
            quantized_kernel=quantized,
        )
        if self.preferred_element_type is not None:
            y = y.astype(self.preferred_element_type)
        return y


class ShardedMoE(nnx.Module):
    """`jax_qtrain.nn.MoE` with its expert kernels split over `sharding.axis` and its tokens
    over `sharding.batch_axes` (data parallel); the router replicated.

    The same parameters (created in the same order from the same `rngs`, so an `nn.MoE` built
    alike starts equal), routing and un-permutation as `nn.MoE`, per device on its own tokens;
    the experts run `fsdp_grouped_mlp` (sharded_grouped.py). So y and the input gradient on a
    device are bit for bit `nn.MoE`'s on that device's tokens; parameter gradients are the sums
    over devices. The load-balancing loss uses the whole batch's expert fractions and mean
    router probabilities (summed over the batch axes), as `nn.MoE` on the whole batch would.

    Args:
      in_features, ffn_features, num_experts, top_k, activation, normalize_top_k,
        aux_loss_coef, recipe, save_original_input, dtype, param_dtype, kernel_init,
        router_init, rngs: as `jax_qtrain.nn.MoE`.
      sharding: a `WeightSharding`; `kernel_dim="experts"` gives each device num_experts/P
        whole experts, 0 or 1 splits every expert's in- or out-features.
      expert_parallel: send the routed rows to the devices that hold their experts
        (`expert_parallel_mlp`, all-to-all) instead of gathering the experts on every device.
        Needs `kernel_dim="experts"` and the expert axis among the batch axes. The experts then
        see the whole batch's rows: with row-local recipes (none, MXFP8, FP8 block) y, the
        input gradient and every parameter gradient equal `nn.MoE` on the whole batch.
      quantized_weight: keep the experts' quantized copies (`quantized_fc1_kernel`,
        `quantized_fc2_kernel`, each expert with its own scales) split like the kernels
        (`SplitKernelLayout(sharding, stacked=True)`): a call gathers the kept fprop copies'
        bytes instead of quantizing the shards, and backward re-gathers the kept dgrad copies;
        `jax_qtrain.nn.Optimizer` (or `refresh_quantized_weights`) rebuilds them after each
        update. With `expert_parallel` each device reads its own experts' kept copies and
        nothing is gathered. Needs `recipe` and strategy "quantize_then_gather"; the results
        equal the layer without kept copies bit for bit.
    """

    def __init__(
        self,
        in_features: int,
        ffn_features: int,
        num_experts: int,
        *,
        sharding: WeightSharding,
        top_k: int = 2,
        activation: str = "swiglu",
        normalize_top_k: bool = True,
        aux_loss_coef: float = 1e-2,
        recipe: Recipe | None = None,
        save_original_input: bool = False,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=default_expert_kernel_init,
        router_init=default_router_init,
        expert_parallel: bool = False,
        quantized_weight: bool = False,
        rngs: nnx.Rngs,
    ):
        if not isinstance(sharding, WeightSharding):
            raise TypeError(f"sharding must be a WeightSharding, got {type(sharding).__name__}")
        if not isinstance(quantized_weight, bool):
            raise TypeError(f"quantized_weight must be a bool, got {quantized_weight!r}")
        if expert_parallel and (
            sharding.kernel_dim != "experts" or sharding.axis not in sharding.batch_axes
        ):
            raise ValueError(
                'expert_parallel=True needs a sharding with kernel_dim="experts" whose axis '
                f"{sharding.axis!r} is also a batch axis (tokens split over it), got "
                f"kernel_dim={sharding.kernel_dim!r}, batch_axes={sharding.batch_axes}"
            )
        check_recipe(recipe)
        check_activation(activation)
        for name, value in (
            ("in_features", in_features),
            ("ffn_features", ffn_features),
            ("num_experts", num_experts),
            ("top_k", top_k),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) must be at most num_experts ({num_experts})")
        split_name, split_size = {
            "experts": ("num_experts", num_experts),
            0: ("in_features and ffn_features", math.gcd(in_features, ffn_features)),
            1: ("ffn_features and in_features", math.gcd(ffn_features, in_features)),
        }[sharding.kernel_dim]
        if split_size % sharding.axis_size:
            raise ValueError(
                f"{split_name} must be multiples of {sharding.axis_size}, the size of mesh axis "
                f"{sharding.axis!r} the experts are split over"
            )
        mesh = sharding.mesh
        self.router = nnx.Linear(
            in_features,
            num_experts,
            use_bias=False,
            dtype=jnp.float32,
            param_dtype=param_dtype,
            kernel_init=router_init,
            kernel_metadata={"out_sharding": (None, None), "mesh": mesh},
            rngs=rngs,
        )
        fc1_out = 2 * ffn_features if is_gated(activation) else ffn_features
        expert_split = {"out_sharding": tuple(sharding.kernel_spec(3)), "mesh": mesh}
        self.fc1_kernel = nnx.Param(
            kernel_init(rngs.params(), (num_experts, in_features, fc1_out), param_dtype),
            **expert_split,
        )
        self.fc2_kernel = nnx.Param(
            kernel_init(rngs.params(), (num_experts, ffn_features, in_features), param_dtype),
            **expert_split,
        )
        self.sharding, self.expert_parallel = sharding, expert_parallel
        self.in_features, self.ffn_features, self.num_experts = (
            in_features,
            ffn_features,
            num_experts,
        )
        self.top_k, self.activation = top_k, activation
        self.normalize_top_k, self.aux_loss_coef = normalize_top_k, aux_loss_coef
        self.recipe, self.save_original_input = recipe, save_original_input
        self.dtype = dtype
        self.aux_loss = nnx.Intermediate(jnp.zeros((), jnp.float32))
        self.tokens_per_expert = nnx.Intermediate(jnp.zeros((num_experts,), jnp.int32))
        layout = SplitKernelLayout(sharding, stacked=True) if quantized_weight else None
        self.quantized_fc1_kernel = keep_quantized(
            self.fc1_kernel[...], recipe, dtype, quantized_weight, layout
        )
        self.quantized_fc2_kernel = keep_quantized(
            self.fc2_kernel[...], recipe, dtype, quantized_weight, layout
        )

    def refresh_quantized_weight(self, add_usages: Iterable[Usage] = ()) -> None:
        """Rebuild the kept quantized copies from fc1 and fc2 (nn.QuantizedWeightLayer)."""
        refresh_mlp_kernels(self, add_usages)

    def _kept_experts(self) -> dict:
        """{"fc1": QuantizedWeight, "fc2": QuantizedWeight} of the kept experts (each carries its
        SplitKernelLayout), or {}."""
        if self.quantized_fc1_kernel is None:
            return {}
        return {
            "fc1": self.quantized_fc1_kernel.get_value(),
            "fc2": self.quantized_fc2_kernel.get_value(),
        }

    def _per_device(self, tokens, router_kernel, fc1_shard, fc2_shard, kept_leaves):
        """One device's tokens through router, experts and un-permutation (`nn.MoE.__call__`).
        `kept_leaves`: this device's leaves of the kept quantized fc1 and fc2 ({} if none)."""
        sharding, top_k, num_experts = self.sharding, self.top_k, self.num_experts
        axes, deterministic = sharding.batch_axes, sharding.deterministic
        if deterministic:  # its gradient summed over the devices in mesh order
            router_kernel = replicated_input(router_kernel, axes)
        logits = lax.dot_general(
            tokens.astype(jnp.float32), router_kernel.astype(jnp.float32), _NN
        )  # nnx.Linear(dtype=float32), as nn.MoE's router
        probs, top_probs, top_experts = route_top_k(
            logits, top_k, normalize_top_k=self.normalize_top_k
        )
        order, inverse, group_sizes = permute_by_expert(top_experts, num_experts)
        x, fc1, fc2 = dtypes.promote_dtype(
            (dispatch_tokens(tokens, order, inverse, top_k), fc1_shard, fc2_shard), dtype=self.dtype
        )
        kept = {
            name: weight.layout.local(weight.tensor, kept_leaves[name])
            for name, weight in self._kept_experts().items()
        }
        if kept:  # the kernels in the dtype the kept copies were made from
            fc1, fc2 = fc1.astype(kept["fc1"].dtype), fc2.astype(kept["fc2"].dtype)
        row_probs = permute_rows(top_probs.reshape(-1), order, inverse)
        if self.expert_parallel:
            expert_out = expert_parallel_mlp(
                x,
                jnp.take(top_experts.reshape(-1), order, axis=0),
                row_probs,
                fc1,
                fc2,
                self.activation,
                axis_name=sharding.axis,
                recipe=self.recipe,
                save_original_input=self.save_original_input,
                quantized_fc1_shard=kept.get("fc1"),
                quantized_fc2_shard=kept.get("fc2"),
            )
        else:
            expert_out = fsdp_grouped_mlp(
                x,
                fc1,
                fc2,
                group_sizes,
                row_probs,
                self.activation,
                axis_name=sharding.axis,
                kernel_dim=sharding.kernel_dim,
                batch_axis_names=sharding.batch_axes,
                strategy=sharding.strategy,
                recipe=self.recipe,
                save_original_input=self.save_original_input,
                deterministic=deterministic,
                quantized_fc1_shard=kept.get("fc1"),
                quantized_fc2_shard=kept.get("fc2"),
            )
        y = combine_slots(expert_out, order, inverse, top_k)

        # The whole batch's load-balancing loss (nn.moe.load_balancing_loss on all tokens).
        counts = lax.psum(expert_counts(top_experts, num_experts), axes)
        fraction = lax.stop_gradient(counts / jnp.sum(counts))
        probs_sum = psum(jnp.sum(probs, axis=0), axes, deterministic=deterministic)
        mean_probs = probs_sum / lax.psum(probs.shape[0], axes)
        aux_loss = self.aux_loss_coef * num_experts * jnp.sum(fraction * mean_probs)
        return y, aux_loss, counts.astype(jnp.int32)

    def __call__(self, x: jax.Array, *, return_aux_loss: bool = False):
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x's last dim must be {self.in_features}, got {x.shape[-1]}")
        tokens = x.reshape(-1, self.in_features)
        sharding = self.sharding
        if tokens.shape[0] % sharding.batch_size_divisor:
            raise ValueError(
                f"x's {tokens.shape[0]} tokens must be a multiple of "
                f"{sharding.batch_size_divisor}, the number of shards of batch_axes "
                f"{sharding.batch_axes}"
            )
        replicated, experts = PartitionSpec(), sharding.kernel_spec(3)
        specs = (sharding.batch_spec(), replicated, experts, experts)
        operands = (tokens, self.router.kernel[...], self.fc1_kernel[...], self.fc2_kernel[...])
        kept_leaves, kept_specs = {}, {}
        for name, weight in self._kept_experts().items():
            leaves, kept_specs[name] = weight.layout.operands(weight.tensor)
            kept_leaves[name] = {
                leaf: laid_out(value, kept_specs[name][leaf], sharding.mesh)
                for leaf, value in leaves.items()
            }
        y, aux_loss, tokens_per_expert = jax.shard_map(
            self._per_device,
            mesh=sharding.mesh,
            in_specs=(*specs, kept_specs),
            out_specs=(sharding.batch_spec(), replicated, replicated),
        )(
            *(laid_out(a, spec, sharding.mesh) for a, spec in zip(operands, specs, strict=True)),
            kept_leaves,
        )
        for name, value in (("aux_loss", aux_loss), ("tokens_per_expert", tokens_per_expert)):
            self.sow(nnx.Intermediate, name, value, reduce_fn=_latest, init_fn=_nothing)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return (y, aux_loss) if return_aux_loss else y
