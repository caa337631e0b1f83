"""`QuantizerSpec`: the static description of how one tensor is quantized.

A recipe (jax_qtrain.recipes) turns a tensor role ("input", "weight", "grad") into a spec;
everything below the recipe (the jnp references, the kernels, QuantizedTensor) only sees specs.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
import numpy as np

from jax_qtrain.formats.common import FLOAT8_DTYPES

FormatName = Literal["fp8", "fp8_block", "mxfp8", "nvfp4"]
FORMAT_NAMES: tuple[str, ...] = ("fp8", "fp8_block", "mxfp8", "nvfp4")


@dataclasses.dataclass(frozen=True)
class QuantizerSpec:
    """How one tensor is quantized. Hashable, so it can be static metadata under jit.

    Attributes:
      format: "fp8" (per-tensor current scaling), "fp8_block", "mxfp8" or "nvfp4".
      dtype: dtype of the codes: float8_e4m3fn / float8_e5m2, or float4_e2m1fn for NVFP4
        (NVFP4 codes are stored packed in uint8; the dtype names the values, not the storage).
      block_shape: (block_rows, block_cols) of the rowwise copy; None for per-tensor FP8.
      power_2_scale: round scales down to powers of two (FP8 and FP8 block).
      amax_epsilon: lower bound applied to the amax before computing a scale (FP8, FP8 block).
      hadamard_columnwise: apply the 16-point random Hadamard transform to the columnwise copy
        before quantizing it (NVFP4 inputs and gradients).
      stochastic_rounding: round E2M1 codes stochastically (NVFP4 gradients); needs a key.
    """

    format: FormatName
    dtype: np.dtype
    block_shape: tuple[int, int] | None = None
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    hadamard_columnwise: bool = False
    stochastic_rounding: bool = False

    def __post_init__(self):
        if self.format not in FORMAT_NAMES:
            raise ValueError(f"format must be one of {FORMAT_NAMES}, got {self.format!r}")
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        expected = {
            "fp8": FLOAT8_DTYPES,
            "fp8_block": FLOAT8_DTYPES,
            "mxfp8": FLOAT8_DTYPES,
            "nvfp4": (jnp.dtype(jnp.float4_e2m1fn),),
        }[self.format]
        if self.dtype not in expected:
            raise ValueError(
                f"dtype for format {self.format!r} must be one of "
                f"{[str(d) for d in expected]}, got {self.dtype}"
            )
        if (self.format == "fp8") != (self.block_shape is None):
            raise ValueError(
                f"block_shape must be None exactly for per-tensor 'fp8', got {self.block_shape!r} "
                f"for format {self.format!r}"
            )
        if self.block_shape is not None:
            if len(self.block_shape) != 2 or any(int(b) <= 0 for b in self.block_shape):
                raise ValueError(f"block_shape must be two positive ints, got {self.block_shape!r}")
            object.__setattr__(self, "block_shape", tuple(int(b) for b in self.block_shape))
        if self.amax_epsilon < 0:
            raise ValueError(f"amax_epsilon must be >= 0, got {self.amax_epsilon}")
        if self.hadamard_columnwise and self.format != "nvfp4":
            raise ValueError("hadamard_columnwise is an NVFP4 option")
        if self.stochastic_rounding and self.format != "nvfp4":
            raise ValueError("stochastic_rounding is an NVFP4 option")

    @property
    def is_2d_block(self) -> bool:
        return self.block_shape is not None and self.block_shape[0] > 1

    @property
    def padding_block(self) -> tuple[int, int]:
        """Block the stored copy is padded to ((1, 1) for per-tensor FP8)."""
        return self.block_shape or (1, 1)

    def describe(self) -> str:
        parts = [self.format, _SHORT_DTYPE_NAMES.get(str(self.dtype), str(self.dtype))]
        if self.block_shape is not None:
            parts.append(f"{self.block_shape[0]}x{self.block_shape[1]}")
        if self.power_2_scale:
            parts.append("pow2")
        if self.hadamard_columnwise:
            parts.append("rht")
        if self.stochastic_rounding:
            parts.append("sr")
        return " ".join(parts)


_SHORT_DTYPE_NAMES = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2", "float4_e2m1fn": "e2m1"}
