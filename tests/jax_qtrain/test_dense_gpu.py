"""The dense/override tests again, on the H200 (`python3 -m pytest -m gpu`).

XLA:GPU can erase fake-quant round trips that the CPU keeps and fuses differently, so every
bit-exact assertion of test_dense.py is repeated there; `test_modes_differ_where_they_should`
checks that "dequantized" really differs from "high_precision" on the GPU.
"""

import pytest

from .test_dense import *  # noqa: F403  (re-collect every test under the gpu marker)

pytestmark = [pytest.mark.gpu, pytest.mark.reference_gemms]  # see tests/conftest.py
