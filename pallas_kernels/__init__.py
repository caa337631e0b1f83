"""Pallas (Mosaic GPU) kernels for Hopper. Never imports jax_qtrain."""

# Quantize / dequantize kernels (issue 4).
from pallas_kernels.cast_transpose_fp8 import CastTransposeConfig as CastTransposeConfig
from pallas_kernels.cast_transpose_fp8 import CastTransposed as CastTransposed
from pallas_kernels.cast_transpose_fp8 import cast_transpose_fp8 as cast_transpose_fp8
from pallas_kernels.dequantize import DequantizeConfig as DequantizeConfig
from pallas_kernels.dequantize import dequantize_fp8_block as dequantize_fp8_block
from pallas_kernels.dequantize import dequantize_mxfp8 as dequantize_mxfp8
from pallas_kernels.dequantize import dequantize_nvfp4 as dequantize_nvfp4

# Grouped (MoE) matmul kernels (issue 5).
from pallas_kernels.grouped_matmul_dense import dense_matmul as dense_matmul
from pallas_kernels.grouped_matmul_dense import dense_matmul_fp8_block as dense_matmul_fp8_block
from pallas_kernels.grouped_matmul_dense import (
    dense_matmul_fp8_block_wgrad as dense_matmul_fp8_block_wgrad,
)
from pallas_kernels.grouped_matmul_fwd import GroupedMatmulConfig as GroupedMatmulConfig
from pallas_kernels.grouped_matmul_fwd import grouped_matmul as grouped_matmul
from pallas_kernels.grouped_matmul_fwd import grouped_matmul_fp8_block as grouped_matmul_fp8_block
from pallas_kernels.grouped_matmul_mx import grouped_matmul_mxfp8 as grouped_matmul_mxfp8
from pallas_kernels.grouped_matmul_mx_weights import (
    grouped_matmul_mxfp8_weights as grouped_matmul_mxfp8_weights,
)
from pallas_kernels.grouped_matmul_mx_weights import (
    grouped_matmul_nvfp4_weights as grouped_matmul_nvfp4_weights,
)
from pallas_kernels.grouped_matmul_wgrad import GroupedWgradConfig as GroupedWgradConfig
from pallas_kernels.grouped_matmul_wgrad import grouped_matmul_wgrad as grouped_matmul_wgrad
from pallas_kernels.quantize_fp8_block import FP8BlockQuantizeConfig as FP8BlockQuantizeConfig
from pallas_kernels.quantize_fp8_block import FP8BlockQuantized as FP8BlockQuantized
from pallas_kernels.quantize_fp8_block import quantize_fp8_block as quantize_fp8_block
from pallas_kernels.quantize_mxfp8 import MXFP8QuantizeConfig as MXFP8QuantizeConfig
from pallas_kernels.quantize_mxfp8 import MXFP8Quantized as MXFP8Quantized
from pallas_kernels.quantize_mxfp8 import quantize_mxfp8 as quantize_mxfp8
from pallas_kernels.quantize_nvfp4 import NVFP4QuantizeConfig as NVFP4QuantizeConfig
from pallas_kernels.quantize_nvfp4 import NVFP4Quantized as NVFP4Quantized
from pallas_kernels.quantize_nvfp4 import nvfp4_amax as nvfp4_amax
from pallas_kernels.quantize_nvfp4 import nvfp4_block_amax_bits as nvfp4_block_amax_bits
from pallas_kernels.quantize_nvfp4 import nvfp4_line_amax_bits as nvfp4_line_amax_bits
from pallas_kernels.quantize_nvfp4 import quantize_nvfp4 as quantize_nvfp4
