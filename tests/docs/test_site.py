"""The documentation site: `mkdocs build --strict` succeeds, and every page under docs/ is in
the navigation (or deliberately left out of it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[2]
# Pages that exist on purpose without a navigation entry (none yet).
NOT_IN_NAV: set[str] = set()


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    in_nav = _nav_pages(config["nav"])
    on_disk = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    missing = sorted(on_disk - set(in_nav) - NOT_IN_NAV)
    assert not missing, f"add these pages to mkdocs.yml's nav (or to NOT_IN_NAV): {missing}"
    assert not set(in_nav) - on_disk, "mkdocs.yml's nav names pages that do not exist"
    assert len(in_nav) == len(set(in_nav))


def test_mkdocs_build_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "index.html").exists()
    assert (tmp_path / "training" / "index.html").exists()
