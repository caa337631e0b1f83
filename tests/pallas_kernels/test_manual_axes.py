"""Kernel outputs inside `jax.shard_map` are typed varying over the axes their inputs vary over.

`plgpu.kernel` types its outputs invariant (the same on every device) whatever its inputs. Under
shard_map JAX acts on those types: a custom_vjp whose cotangent's type differs from its primal's
fails, and an invariant value may leave the shard_map as replicated (one device's copy). On the H200
(2026-11-30) the sharded layers that quantize on a kernel failed that way. Tracing is enough to
see the types (nothing runs, so this is quick on the CPU).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 2, reason="needs 2 devices (tests/conftest.py)"
)

E4M3 = jnp.float8_e4m3fn


def varying_axes(value) -> frozenset:
    return frozenset(jax.typeof(value).manual_axis_type.varying)


def output_axes(kernel, *args, sharded=(0,)):
    """The varying axes of every output leaf of `kernel(*args)` traced inside a shard_map over
    "fsdp" that splits the arguments at positions `sharded` along their first dimension."""
    mesh = jax.make_mesh((2,), ("fsdp",))
    specs = tuple(P("fsdp") if i in sharded else P() for i in range(len(args)))
    found = []

    def body(*local):
        outputs = kernel(*local)
        found.extend(varying_axes(leaf) for leaf in jax.tree.leaves(outputs))
        return jnp.zeros((), jnp.float32)

    abstract = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.NamedSharding(mesh, spec))
        for a, spec in zip(args, specs, strict=True)
    ]
    jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P()))(*abstract)
    assert found, "the kernel returned no arrays"
    return found


def bf16(*shape):
    return jnp.ones(shape, jnp.bfloat16)


QUANTIZE_KERNELS = {
    "mxfp8": lambda x: pk.quantize_mxfp8(x, rowwise=True, columnwise=True, interpret=True),
    "mxfp8 columnwise only": lambda x: pk.quantize_mxfp8(
        x, rowwise=False, columnwise=True, interpret=True
    ),
    "fp8 block": lambda x: pk.quantize_fp8_block(
        x, block_shape=(128, 128), rowwise=True, columnwise=True, interpret=True
    ),
    "nvfp4": lambda x: pk.quantize_nvfp4(
        x,
        rowwise=True,
        columnwise=True,
        rowwise_amax=jnp.float32(1),
        columnwise_amax=jnp.float32(1),
        hadamard_columnwise=True,
        interpret=True,
    ),
    "nvfp4 amax": lambda x: pk.nvfp4_amax(x, hadamard_columnwise=True, interpret=True),
    "cast-transpose": lambda x: pk.cast_transpose_fp8(
        x.astype(jnp.float32), rowwise=True, columnwise=True, fp8_dtype=E4M3, interpret=True
    ),
    "dequantize mxfp8": lambda x: pk.dequantize_mxfp8(
        x.astype(E4M3), jnp.full((x.shape[0], x.shape[1] // 32), 127, jnp.uint8), interpret=True
    ),
}


@pytest.mark.parametrize("name", list(QUANTIZE_KERNELS))
def test_quantize_kernel_outputs_vary_like_their_input(name):
    for axes in output_axes(QUANTIZE_KERNELS[name], bf16(256, 256)):
        assert axes == {"fsdp"}, name


def test_grouped_matmul_outputs_vary_like_their_operands():
    sizes = jnp.array([64, 64], jnp.int32)  # the same on every device: invariant
    forward = output_axes(
        lambda lhs, rhs, sizes: pk.grouped_matmul(lhs, rhs, sizes, interpret=True),
        bf16(256, 128),
        bf16(2, 128, 128),
        sizes,
    )
    wgrad = output_axes(
        lambda lhs, rhs, sizes: pk.grouped_matmul_wgrad(lhs, rhs, sizes, interpret=True),
        bf16(256, 128),  # (K, M): split along K here, as any split of an operand must show
        bf16(128, 128),
        sizes,
    )
    block_fp8 = output_axes(
        lambda lhs, scale, rhs, rhs_scale: pk.dense_matmul_fp8_block(
            lhs, scale, rhs, rhs_scale, interpret=True
        ),
        jnp.ones((256, 128), E4M3),
        jnp.ones((256, 1), jnp.float32),
        jnp.ones((128, 128), E4M3),
        jnp.ones((1, 1), jnp.float32),
        sharded=(0, 1),
    )
    for axes in forward + wgrad + block_fp8:
        assert axes == {"fsdp"}


def test_outputs_of_invariant_inputs_stay_invariant():
    # Every device quantizing the same (gathered) tensor gets the same codes: invariant is right.
    for axes in output_axes(QUANTIZE_KERNELS["mxfp8"], bf16(256, 256), sharded=()):
        assert axes == frozenset()
