"""The measured tables quoted in docs/ stay in sync with the code that produces them."""

from pathlib import Path

from benchmarks import residual_bytes

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_overrides_residual_table_is_current():
    table = residual_bytes.markdown(8192, 4096)
    assert table.strip() in (DOCS / "overrides.md").read_text()
