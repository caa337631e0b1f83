"""`quantize` and `QuantizedTensor`: one tensor, up to two quantized copies.

Layout (docs/design/layouts.md): the input is viewed as 2-D (M, K), leading dims flattened. The
rowwise copy has blocks along K and is stored (M, K); the columnwise copy has blocks along M and
is stored transposed, (K, M), so that it is simply the rowwise quantization of xᵀ (rotated by the
Hadamard transform first for NVFP4 inputs and gradients). Both copies are zero-padded up to block
multiples; `dequantize` strips the padding.
"""

from __future__ import annotations

import functools
import math
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_qtrain import kernels
from jax_qtrain.formats import common, fp8_block, fp8_tensor, mxfp8, nvfp4
from jax_qtrain.formats.spec import QuantizerSpec
from jax_qtrain.recipes import Recipe, Role, check_recipe

Usage = Literal["rowwise", "columnwise"]
USAGES: tuple[str, ...] = get_args(Usage)
Backend = Literal["auto", "reference", "pallas"]
BACKENDS: tuple[str, ...] = get_args(Backend)
ScaleLayout = Literal["lines", "tiles"]  # docs/design/layouts.md, "GEMM-ready scales"
SCALE_LAYOUTS: tuple[str, ...] = get_args(ScaleLayout)

# How each format stores its scales, for repr and docs.
_SCALE_STORAGE = {"fp8": "fp32", "fp8_block": "fp32", "mxfp8": "E8M0 bytes", "nvfp4": "E4M3"}


@jax.tree_util.register_pytree_node_class
class QuantizedTensor:
    """A quantized tensor: a rowwise and/or a columnwise copy, plus static metadata.

    Array fields (pytree leaves; a copy that was not requested is None):
      rowwise_data, rowwise_scale_inv: codes and scales of the rowwise copy, (M, K) layout.
      columnwise_data, columnwise_scale_inv: the columnwise copy, stored transposed, (K, M).
      rowwise_amax, columnwise_amax: NVFP4's float32 global amax of each copy (None otherwise).
    Static metadata: `spec` (format and options), `shape` and `dtype` of the original tensor,
    and `scale_layout`: "lines" (the default: each copy's block scales (lines, blocks), the
    formats' layout) or "tiles" (MXFP8 and FP8 block 1×128 only: "GEMM-ready" scales,
    (blocks / blocks_per_tile, lines, blocks_per_tile) with 128-wide tiles, what the quantize
    kernels write and the block-FP8 GEMM reads; `line_scale_inv` gives either as lines,
    docs/design/layouts.md).

    Codes: FP8 formats store real float8_e4m3fn / float8_e5m2 arrays (XLA's FP8 dot_general and
    Mosaic GPU's wgmma consume them directly); NVFP4 stores two E2M1 codes per uint8, element 2i
    in the low nibble, because Hopper kernels cannot emit float4 and packing halves the bytes.
    Scales: float32 (FP8, FP8 block), E8M0 as uint8 bytes (MXFP8: JAX's e8m0 cast rounds to
    nearest and has no zero, and Hopper kernels cannot emit it), float8_e4m3fn (NVFP4).
    """

    def __init__(
        self,
        *,
        spec: QuantizerSpec,
        shape: tuple[int, ...],
        dtype,
        rowwise_data: jax.Array | None = None,
        rowwise_scale_inv: jax.Array | None = None,
        columnwise_data: jax.Array | None = None,
        columnwise_scale_inv: jax.Array | None = None,
        rowwise_amax: jax.Array | None = None,
        columnwise_amax: jax.Array | None = None,
        scale_layout: ScaleLayout = "lines",
    ):
        _check_scale_layout(scale_layout, spec)
        self.scale_layout = scale_layout
        self.spec = spec
        self.shape = tuple(shape)
        self.dtype = jnp.dtype(dtype)
        self.rowwise_data = rowwise_data
        self.rowwise_scale_inv = rowwise_scale_inv
        self.columnwise_data = columnwise_data
        self.columnwise_scale_inv = columnwise_scale_inv
        self.rowwise_amax = rowwise_amax
        self.columnwise_amax = columnwise_amax

    # --- pytree -------------------------------------------------------------------------------
    _LEAF_FIELDS = (
        "rowwise_data",
        "rowwise_scale_inv",
        "columnwise_data",
        "columnwise_scale_inv",
        "rowwise_amax",
        "columnwise_amax",
    )

    def tree_flatten(self):
        children = tuple(getattr(self, name) for name in self._LEAF_FIELDS)
        return children, (self.spec, self.shape, self.dtype, self.scale_layout)

    @classmethod
    def tree_unflatten(cls, aux, children):
        spec, shape, dtype, scale_layout = aux
        return cls(
            spec=spec,
            shape=shape,
            dtype=dtype,
            scale_layout=scale_layout,
            **dict(zip(cls._LEAF_FIELDS, children, strict=True)),
        )

    # --- metadata -----------------------------------------------------------------------------
    @property
    def shape2d(self) -> tuple[int, int]:
        """The (M, K) view: leading dims flattened."""
        return (math.prod(self.shape[:-1]), self.shape[-1])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def usages(self) -> tuple[str, ...]:
        """The copies this tensor holds, e.g. ("rowwise", "columnwise")."""
        return tuple(u for u in USAGES if self._data(u) is not None)

    def has_usage(self, usage: Usage) -> bool:
        _check_usage(usage)
        return self._data(usage) is not None

    @property
    def nbytes(self) -> int:
        """Bytes held by all copies: codes, scales and global amaxes."""
        return sum(
            int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
            for leaf in jax.tree_util.tree_leaves(self)
        )

    def _data(self, usage: str):
        return self.rowwise_data if usage == "rowwise" else self.columnwise_data

    def _scale_inv(self, usage: str):
        return self.rowwise_scale_inv if usage == "rowwise" else self.columnwise_scale_inv

    def _amax(self, usage: str):
        return self.rowwise_amax if usage == "rowwise" else self.columnwise_amax

    def _require(self, usage: str) -> None:
        _check_usage(usage)
        if self._data(usage) is None:
            raise ValueError(
                f"usage={usage!r}: this tensor holds only {list(self.usages)}; quantize with "
                f"{usage}=True to get that copy"
            )

    # --- views --------------------------------------------------------------------------------
    def restrict_to(self, *usages: Usage) -> QuantizedTensor:
        """The same tensor keeping only the named copies (e.g. the one a GEMM will read)."""
        for usage in usages:
            self._require(usage)
        fields = {name: getattr(self, name) for name in self._LEAF_FIELDS}
        for usage in USAGES:
            if usage not in usages:
                for part in ("data", "scale_inv", "amax"):
                    fields[f"{usage}_{part}"] = None
        return self._replace(fields, self.scale_layout)

    def line_scale_inv(self, usage: Usage = "rowwise") -> jax.Array:
        """One copy's scales in the formats' (lines, blocks) layout, whatever `scale_layout`
        holds them in (a transpose for "tiles", which XLA fuses into its consumer)."""
        self._require(usage)
        scale_inv = self._scale_inv(usage)
        return common.untile_scales(scale_inv) if self.scale_layout == "tiles" else scale_inv

    def with_scale_layout(self, scale_layout: ScaleLayout) -> QuantizedTensor:
        """The same tensor with its block scales in `scale_layout` ("lines" or "tiles")."""
        _check_scale_layout(scale_layout, self.spec)
        if scale_layout == self.scale_layout:
            return self
        fields = {name: getattr(self, name) for name in self._LEAF_FIELDS}
        for usage in self.usages:
            lines = self.line_scale_inv(usage)
            fields[f"{usage}_scale_inv"] = (
                lines if scale_layout == "lines" else tile_line_scales(lines, self.spec)
            )
        return self._replace(fields, scale_layout)

    def _replace(self, fields: dict, scale_layout: str) -> QuantizedTensor:
        return QuantizedTensor(
            spec=self.spec,
            shape=self.shape,
            dtype=self.dtype,
            scale_layout=scale_layout,
            **fields,
        )

    def dequantize_stored(self, usage: Usage = "rowwise") -> jax.Array:
        """float32 values of one copy exactly as stored: 2-D, padded to block multiples, the
        columnwise copy transposed (K', M') and, with the Hadamard transform, still rotated.

        This is what a GEMM reads: two rotated copies contracted over the padded token axis give
        the unrotated product (M·Mᵀ = I, and padding contributes zeros).
        """
        self._require(usage)
        return _dequantize_stored(self, usage)

    def dequantize(self, usage: Usage = "rowwise", dtype=None) -> jax.Array:
        """Values of one copy in the original shape and layout, as `dtype` (default: the
        original dtype). A rotated NVFP4 columnwise copy is rotated back (fp32 arithmetic, so
        exact only up to fp32 rounding)."""
        self._require(usage)
        return _dequantize(self, usage, self.dtype if dtype is None else jnp.dtype(dtype))

    def __repr__(self) -> str:
        def describe(usage):
            data, scale = self._data(usage), self._scale_inv(usage)
            text = (
                f"{usage}: data {_leaf_str(data)}, scale_inv {_leaf_str(scale)} "
                f"({_SCALE_STORAGE[self.spec.format]})"
            )
            if self._amax(usage) is not None:
                text += ", global amax float32[]"
            return text

        layout = ", scale_layout='tiles'" if self.scale_layout == "tiles" else ""

        copies = ",\n  ".join(describe(u) for u in self.usages) or "no copies"
        return (
            f"QuantizedTensor({self.spec.describe()}, shape={self.shape}, dtype={self.dtype}"
            f"{layout},\n"
            f"  {copies},\n  nbytes={self.nbytes:,})"
        )


@functools.partial(jax.jit, static_argnames=("usage",))
def _dequantize_stored(q: QuantizedTensor, usage: str) -> jax.Array:
    data, scale_inv = q._data(usage), q.line_scale_inv(usage)
    fmt = q.spec.format
    if fmt == "fp8":
        return fp8_tensor.dequantize(data, scale_inv)
    if fmt == "fp8_block":
        return fp8_block.dequantize(data, scale_inv, q.spec)
    if fmt == "mxfp8":
        return mxfp8.dequantize(data, scale_inv)
    return nvfp4.dequantize(data, scale_inv, q.spec, global_amax=q._amax(usage))


@functools.partial(jax.jit, static_argnames=("usage", "dtype"))
def _dequantize(q: QuantizedTensor, usage: str, dtype) -> jax.Array:
    values = _dequantize_stored(q, usage)
    rows, cols = q.shape2d
    if usage == "columnwise":
        if q.spec.hadamard_columnwise:
            values = nvfp4.inverse_hadamard16(values)
        values = values[:cols, :rows].T
    else:
        values = values[:rows, :cols]
    return values.reshape(q.shape).astype(dtype)


def tile_line_scales(line_scales: jax.Array, spec: QuantizerSpec) -> jax.Array:
    """A copy's (lines, blocks) scales in the "tiles" layout of `spec`'s blocks."""
    return common.tile_scales(line_scales, common.scale_blocks_per_tile(spec.block_shape[1]))


def tiles_layout_applies(spec: QuantizerSpec) -> bool:
    """Whether `spec`'s scales have a "tiles" layout: per-line block scales (MXFP8, FP8 block
    1×128) whose blocks fill a 128-wide tile."""
    return (
        spec.format in ("mxfp8", "fp8_block")
        and spec.block_shape[0] == 1
        and common.SCALE_TILE % spec.block_shape[1] == 0
    )


def _check_scale_layout(scale_layout, spec: QuantizerSpec) -> None:
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {list(SCALE_LAYOUTS)}, got {scale_layout!r}")
    if scale_layout == "tiles" and not tiles_layout_applies(spec):
        raise ValueError(
            f"scale_layout='tiles': only MXFP8 and FP8 block 1×128 scales have a tiles layout, "
            f"not {spec.describe()}'s; use scale_layout='lines'"
        )


def _check_tiles_shape(scale_layout: str, shape2d: tuple[int, int]) -> None:
    if scale_layout == "tiles" and any(n % common.SCALE_TILE for n in shape2d):
        raise ValueError(
            f"scale_layout='tiles': x's 2-D view (M, K) must be whole {common.SCALE_TILE}×"
            f"{common.SCALE_TILE} tiles, got {tuple(shape2d)}; use scale_layout='lines'"
        )


def _leaf_str(leaf) -> str:
    return f"{jnp.dtype(leaf.dtype).name}[{','.join(map(str, leaf.shape))}]"


def _check_usage(usage) -> None:
    if usage not in USAGES:
        raise ValueError(f"usage must be one of {list(USAGES)}, got {usage!r}")


def _validate_input(x) -> None:
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"x must be a JAX or NumPy array, got {type(x).__name__}")
    dtype = jnp.dtype(x.dtype)
    if dtype not in common.SUPPORTED_INPUT_DTYPES:
        raise TypeError(
            f"x must have dtype float32, bfloat16 or float16 (the high-precision tensor to "
            f"quantize), got {dtype}"
        )
    if len(x.shape) == 0:
        raise ValueError("x must have at least one dimension, got a scalar")
    if math.prod(x.shape) == 0:
        raise ValueError(f"x must not be empty, got shape {tuple(x.shape)}")


def _check_key(key, spec: QuantizerSpec) -> None:
    if not spec.stochastic_rounding:
        return
    if key is None:
        raise ValueError(
            f"key is required: {spec.describe()} rounds stochastically (a gradient under "
            "NVFP4BlockScaling); pass key=jax.random.key(...)"
        )
    if not (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        or (jnp.dtype(key.dtype) == jnp.uint32 and key.shape[-1:] == (2,))
    ):
        raise TypeError(f"key must be a jax.random key, got {key.dtype}{tuple(key.shape)}")


def _copy_seed(key, usage: str) -> jax.Array:
    return jax.random.bits(jax.random.fold_in(key, USAGES.index(usage)), (), jnp.uint32)


def quantize_reference_copy(
    source: jax.Array,
    spec: QuantizerSpec,
    *,
    input_dtype,
    tensor_amax: jax.Array | None = None,
    seed: jax.Array | None = None,
    origin: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The jnp reference for one copy: quantize the rows of a 2-D `source` (x for the rowwise
    copy, the (rotated) xᵀ for the columnwise one). Returns (data, scale_inv, global amax or None).

    `tensor_amax` is the copy's amax for per-tensor scales (FP8, NVFP4's global scale); it is
    computed here when not given. `origin`: see `formats/nvfp4.py::stochastic_uniforms`.
    """
    fmt = spec.format
    if fmt in ("fp8", "nvfp4") and tensor_amax is None:
        tensor_amax = common.amax(source)
    if fmt == "fp8":
        data, scale_inv = fp8_tensor.quantize(source, spec, tensor_amax=tensor_amax)
        return common.materialize(data), scale_inv, None
    if fmt == "fp8_block":
        data, scale_inv = fp8_block.quantize(source, spec, input_dtype=input_dtype)
        return common.materialize(data), scale_inv, None
    if fmt == "mxfp8":
        data, scale_inv = mxfp8.quantize(source, spec)
        return common.materialize(data), scale_inv, None
    data, scale_inv = nvfp4.quantize(
        source, spec, global_amax=tensor_amax, seed=seed, origin=origin
    )
    return data, common.materialize(scale_inv), tensor_amax


def columnwise_source(
    x2d: jax.Array, spec: QuantizerSpec, *, separate_transpose: bool = False
) -> jax.Array:
    """What the columnwise copy quantizes: xᵀ, rotated by the Hadamard transform if asked.

    `separate_transpose`: transpose x in a pass of its own (a barrier keeps XLA from fusing it
    into the quantizer), so the quantizer reads xᵀ in memory order; see grouped_quantize."""
    source = x2d.T
    if separate_transpose:
        source = common.materialize(source)
    if spec.hadamard_columnwise:
        source = nvfp4.hadamard16(common.pad_to_blocks(source.astype(jnp.float32), 1, 16))
    return source


def quantize(
    x: jax.Array,
    recipe: Recipe | QuantizerSpec,
    role: Role = "input",
    rowwise: bool = True,
    columnwise: bool = False,
    key: jax.Array | None = None,
    *,
    backend: Backend = "auto",
    amax_axis_name: str | tuple[str, ...] | None = None,
    position_offset: tuple[int | jax.Array, int | jax.Array] | None = None,
    scale_layout: ScaleLayout = "lines",
) -> QuantizedTensor:
    """Quantize `x` as `recipe` quantizes a tensor of this `role`.

    Args:
      x: float32 / bfloat16 / float16 array of any rank ≥ 1, viewed as 2-D (M, K).
      recipe: a recipe (jax_qtrain.recipes), or a QuantizerSpec (then `role` is unused).
      role: "input", "weight" or "grad"; picks the FP8 dtype, block shape, Hadamard transform
        and stochastic rounding the recipe uses for that tensor.
      rowwise, columnwise: which copies to produce (at least one).
      key: jax.random key, required when the spec rounds stochastically (NVFP4 gradients); the
        same key gives the same codes.
      backend: "reference" (the jnp code here), "pallas" (the Hopper kernels; an error if there
        is none for this format and shape), or "auto": kernels on GPU where they apply, else the
        reference.
      amax_axis_name: inside `shard_map`, a mesh axis (or axes) over which per-tensor amaxes
        (FP8, NVFP4's global amax) are max-reduced, so quantizing shards equals quantizing the
        whole tensor (block formats need no reduction when shards are block-aligned).
      position_offset: (row, col) of x's first element (2-D view) in the whole tensor that x is
        a shard of. Stochastic rounding draws its random bits from each element's position, so
        with the offset (and the whole tensor's key) a shard is rounded exactly as the whole
        tensor would be. Only stochastic rounding reads it. The NVFP4 kernel takes it
        (`kernels.kernel_takes_position_offset`); a format whose kernel does not stays on the
        reference under backend="auto".
      scale_layout: "lines" (the formats' (lines, blocks) scales) or "tiles" (MXFP8 and FP8
        block 1×128, x's 2-D view whole 128×128 tiles: the GEMM-ready layout the quantize
        kernels write, so they skip rearranging it; TransformerEngine's `optimize_for_gemm`
        plays this part). Both backends give the same bytes in either layout.
    """
    if isinstance(recipe, QuantizerSpec):
        spec = recipe
    else:
        check_recipe(recipe, allow_none=False, or_also="a QuantizerSpec")
        spec = recipe.spec(role)
    _validate_input(x)
    _check_scale_layout(scale_layout, spec)
    _check_tiles_shape(scale_layout, (math.prod(x.shape[:-1]), x.shape[-1]))
    for name, flag in (("rowwise", rowwise), ("columnwise", columnwise)):
        if not isinstance(flag, bool | np.bool_):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if not (rowwise or columnwise):
        raise ValueError("rowwise and columnwise are both False: ask for at least one copy")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    _check_key(key, spec)
    if position_offset is not None:
        if not (isinstance(position_offset, tuple | list) and len(position_offset) == 2):
            raise TypeError(
                f"position_offset must be a (row, col) pair of ints or int arrays, got "
                f"{position_offset!r}"
            )
        position_offset = tuple(jnp.asarray(p, jnp.uint32) for p in position_offset)

    return _quantize(
        jnp.asarray(x),
        key,
        position_offset,
        spec=spec,
        rowwise=bool(rowwise),
        columnwise=bool(columnwise),
        backend=backend,
        amax_axis_name=amax_axis_name,
        scale_layout=scale_layout,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "spec",
        "rowwise",
        "columnwise",
        "backend",
        "amax_axis_name",
        "scale_layout",
    ),
)
def _quantize(
    x, key, position_offset, *, spec, rowwise, columnwise, backend, amax_axis_name, scale_layout
) -> QuantizedTensor:
    # Jitted so that eager calls compile once per shape (inside a caller's jit it is inlined).
    x2d = common.rounded_input(x.reshape(-1, x.shape[-1]))
    offset_matters = position_offset is not None and spec.stochastic_rounding
    use_kernel = backend == "pallas" or (
        backend == "auto"
        and (not offset_matters or kernels.kernel_takes_position_offset(spec))
        and kernels.quantize_kernel_applies(spec, x2d.shape, x2d.dtype)
    )

    usages = [u for u, wanted in (("rowwise", rowwise), ("columnwise", columnwise)) if wanted]
    if use_kernel:
        kernels.require_quantize_kernel(spec, x2d.shape, x2d.dtype)  # before the amax kernels
        sources = {}
        # One Pallas pass for NVFP4's two amaxes; for its 16×16 weight blocks, the pass that
        # the quantize kernel needs anyway (the blocks' amaxes) gives the global one too.
        block_amax_bits = kernels.weight_block_amax_bits(x2d, spec)
        amaxes = kernels.tensor_amaxes(x2d, spec, usages, block_amax_bits=block_amax_bits)
    else:
        sources = {u: x2d if u == "rowwise" else columnwise_source(x2d, spec) for u in usages}
        per_tensor = spec.format in ("fp8", "nvfp4")
        amaxes = {u: common.amax(sources[u]) if per_tensor else None for u in usages}
    if amax_axis_name is not None:
        amaxes = {u: None if a is None else lax.pmax(a, amax_axis_name) for u, a in amaxes.items()}
    seeds = {u: _copy_seed(key, u) if spec.stochastic_rounding else None for u in usages}

    if use_kernel:
        # The kernels read x once and write both copies; they get the (reduced) amaxes and
        # seeds, and for a shard each copy's position (the columnwise copy's lines: x's columns).
        positions = None
        if offset_matters:
            row, col = position_offset
            positions = {u: (row, col) if u == "rowwise" else (col, row) for u in usages}
        fields = kernels.quantize(
            x2d,
            spec,
            input_dtype=x.dtype,
            amaxes=amaxes,
            seeds=seeds,
            positions=positions,
            block_amax_bits=block_amax_bits,
            scale_layout=scale_layout,
        )
    else:
        fields = {}
        for usage in usages:
            origin = None
            if offset_matters:  # the columnwise copy quantizes xᵀ: its (row, col) is x's (col, row)
                row, col = position_offset if usage == "rowwise" else position_offset[::-1]
                origin = (jnp.uint32(0) - row, jnp.uint32(0) - col)  # stochastic_uniforms subtracts
            data, scale_inv, copy_amax = quantize_reference_copy(
                sources[usage],
                spec,
                input_dtype=x.dtype,
                tensor_amax=amaxes[usage],
                seed=seeds[usage],
                origin=origin,
            )
            if scale_layout == "tiles":
                scale_inv = tile_line_scales(scale_inv, spec)
            fields.update(
                {f"{usage}_data": data, f"{usage}_scale_inv": scale_inv, f"{usage}_amax": copy_amax}
            )
    return QuantizedTensor(
        spec=spec, shape=x.shape, dtype=x.dtype, scale_layout=scale_layout, **fields
    )
