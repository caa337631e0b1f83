"""docs/distributed.md quotes the bytes table that benchmarks/sharding_strategies.py computes."""

from pathlib import Path

from benchmarks import sharding_strategies

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_distributed_bytes_table_is_current():
    table = sharding_strategies.bytes_markdown(4096, 8)
    assert table.strip() in (DOCS / "distributed.md").read_text()
