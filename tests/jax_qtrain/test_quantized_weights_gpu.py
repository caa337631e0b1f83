"""The quantized-weight tests again, on the H200 (`python3 -m pytest -m gpu`).

On the GPU the weight quantization and the GEMMs run through other code paths (the Pallas
quantize kernels where they apply, cuBLASLt's FP8 GEMM) and XLA:GPU fuses differently, so the
bit-exact claims (kept copies equal a fresh quantization, cached and uncached runs agree) and the
training-loop checks are repeated there.
"""

import pytest

from .test_quantized_weights import *  # noqa: F403  (re-collect every test under the gpu marker)

pytestmark = [pytest.mark.gpu, pytest.mark.reference_gemms]  # see tests/conftest.py
