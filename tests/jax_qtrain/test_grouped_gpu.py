"""The grouped (MoE) tests again, on the H200 (`python3 -m pytest -m gpu`).

XLA:GPU can erase fake-quant round trips that the CPU keeps and fuses and orders GEMM sums
differently, so every test of the four test_grouped_*.py modules is repeated there.
Comparisons between *different* GEMM implementations (grouped ragged GEMMs against one dense
GEMM per expert, or against JAX's autodiff of ragged_dot) use
`grouped_common.assert_equal_up_to_summation_order`, whose bound is the float32 summation order;
everything computed by the same ops on both sides stays bit-exact.

The modules share test names (e.g. test_residuals_by_name_and_bytes), so each test is re-bound
here as `test_<module>__<name>` instead of star-imported.
"""

import pytest

from . import test_grouped_dense, test_grouped_mlp, test_grouped_nn, test_grouped_quantize

for _module in (test_grouped_quantize, test_grouped_dense, test_grouped_mlp, test_grouped_nn):
    _short = _module.__name__.rsplit(".test_grouped_", 1)[-1]
    for _name, _test in vars(_module).items():
        if _name.startswith("test_") and callable(_test):
            globals()[f"test_{_short}__{_name[len('test_') :]}"] = _test

pytestmark = [pytest.mark.gpu, pytest.mark.reference_gemms]  # see tests/conftest.py
