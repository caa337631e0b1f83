"""The grouped (MoE) tests again, on the H200 (`python3 -m pytest -m gpu`).

XLA:GPU can erase fake-quant round trips that the CPU keeps and fuses and orders GEMM sums
differently, so every assertion of the four test_grouped_*.py modules is repeated there.
Comparisons between *different* GEMM implementations (grouped ragged GEMMs against one dense
GEMM per expert, or against JAX's autodiff of ragged_dot) use
`grouped_common.assert_equal_up_to_summation_order`, whose bound is the float32 summation order;
everything computed by the same ops on both sides stays bit-exact.
"""

import pytest

from .test_grouped_dense import *  # noqa: F403  (re-collect every test under the gpu marker)
from .test_grouped_mlp import *  # noqa: F403
from .test_grouped_nn import *  # noqa: F403
from .test_grouped_quantize import *  # noqa: F403

pytestmark = pytest.mark.gpu
