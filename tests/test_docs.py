"""The README and docs/ tell the truth about the code: every config key is documented, every relative link and
anchor resolves, and the README stays a front door."""

import dataclasses
import re
from pathlib import Path

from conftest import REPO

from lowmem_dpo.config.schema import Config

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md", REPO / "CHANGELOG.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out, seen = set(), {}
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.+)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return out


def test_every_config_key_is_in_the_docs():
    text = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "docs").glob("*.md"))
    missing = [f.name for f in dataclasses.fields(Config) if f"`{f.name}`" not in text]
    assert missing == []


def test_every_link_resolves():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: outside the repository
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or REPO not in [dest, *dest.parents]:
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []


def test_the_readme_is_a_front_door():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    assert "make demo" in readme and "make test" in readme
    assert "../shared" not in readme and not re.search(r"issue \d+", readme, re.I)
    for page in [p for p in PAGES if p.parent.name != "bench"]:  # bench/README keeps its history
        assert not re.search(r"\bissue \d+", page.read_text(encoding="utf-8"), re.I), page.name


def test_the_changelog_maps_every_moved_module_to_one_that_imports():
    """Each old import path the changelog lists is gone, its new one imports, and every module of a part is
    listed: a user's old import finds its new place there."""
    import importlib
    import importlib.util
    import pkgutil

    import lowmem_dpo

    rows = re.findall(r"^\| `(lowmem_dpo\.\w+)` \| `(lowmem_dpo\.[\w.]+)` \|$",
                      (REPO / "CHANGELOG.md").read_text(encoding="utf-8"), re.M)
    assert len(rows) > 30
    for old, new in rows:
        assert importlib.util.find_spec(old) is None or old in ("lowmem_dpo.config", "lowmem_dpo.data"), old
        importlib.import_module(new)
    added_since = {"lowmem_dpo.runtime.builtins", "lowmem_dpo.runtime.folders", "lowmem_dpo.runtime.heap",
                   "lowmem_dpo.runtime.oom", "lowmem_dpo.training.kto", "lowmem_dpo.model.gguf",
                   "lowmem_dpo.training.session", "lowmem_dpo.model.compute_copies",
                   "lowmem_dpo.model.head", "lowmem_dpo.training.objective", "lowmem_dpo.training.step",
                   "lowmem_dpo.runtime.ram", "lowmem_dpo.model.packing",
                   "lowmem_dpo.runtime.kernels", "lowmem_dpo.runtime.sharding",
                   "lowmem_dpo.training.content", "lowmem_dpo.training.answers",
                   "lowmem_dpo.training.signs", "lowmem_dpo.data.sides", "lowmem_dpo.config.checks",
                   "lowmem_dpo.model.sdpa", "lowmem_dpo.training.located"}  # new modules
    moved = {m.name for m in pkgutil.walk_packages(lowmem_dpo.__path__, "lowmem_dpo.") if m.name.count(".") == 2
             and not m.name.startswith(("lowmem_dpo.data.", "lowmem_dpo.memory.", "lowmem_dpo.objectives."))} - added_since
    assert moved <= {new for _, new in rows}
