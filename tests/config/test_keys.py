"""Each config key is used, documented and tested: read by the package beyond its declaration, named in the README
or docs/, and named by a test."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

from lowmem_dpo.config.schema import FIELDS


def test_every_key_is_read_documented_and_tested():
    declared = {REPO / "lowmem_dpo/config/schema.py", REPO / "lowmem_dpo/config/checks.py"}  # the keys, their checks
    code = [p.read_text(encoding="utf-8") for p in (REPO / "lowmem_dpo").rglob("*.py") if p not in declared]
    docs = (REPO / "README.md").read_text(encoding="utf-8") + "".join(
        p.read_text(encoding="utf-8") for p in (REPO / "docs").glob("*.md"))
    tests = "".join(p.read_text(encoding="utf-8") for p in (REPO / "tests").rglob("*.py")
                    if p != Path(__file__))
    missing = {}
    for key in FIELDS:
        where = [name for name, found in (
            ("read", any(re.search(rf"\.{key}\b|[\"']{key}[\"']", text) for text in code)),
            ("documented", re.search(rf"\b{key}\b", docs)), ("tested", re.search(rf"\b{key}\b", tests))) if not found]
        if where:
            missing[key] = where
    assert missing == {}
