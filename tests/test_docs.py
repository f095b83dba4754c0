"""The docs stay findable: every relative link in README.md and docs/ reaches a file
(and a heading, where it names one), docs/index.md lists every page, and
bench/index.py lists every bench script."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def broken_links(pages, root: Path = ROOT) -> list:
    bad = []
    for page in pages:
        name = page.relative_to(root)
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#") and not target[1:]:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{name}: {target} (no such heading)")
    return bad


def test_every_relative_link_resolves():
    bad = broken_links(_pages())
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_link_check_can_fail(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n[ok](a.md#title) [gone](b.md) [heading](a.md#nope)\n")
    assert broken_links([tmp_path / "a.md"], tmp_path) == ["a.md: b.md (no such file)",
                                                         "a.md: a.md#nope (no such heading)"]


def test_the_front_door_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text()
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "index.md" and f"({p.name})" not in index]
    assert not missing, f"docs/index.md does not list {missing}"


def test_the_bench_index_lists_every_bench():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import index
    finally:
        sys.path.remove(str(ROOT / "bench"))
    listed = {b.script for b in index.BENCHES}
    scripts = {p.name for p in (ROOT / "bench").glob("*.py")} - set(index.HELPERS)
    assert scripts == listed, f"bench/index.py: unlisted {sorted(scripts - listed)}, gone {sorted(listed - scripts)}"
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "index.py")], capture_output=True, text=True, check=True)
    assert all(b.name in out.stdout for b in index.BENCHES)
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "index.py"), "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no bench named 'nope'" in bad.stderr


def test_the_settings_page_is_current():
    """docs/settings.md is generated from the schemas: a schema change needs
    `source-patch settings --write docs/settings.md` in the same commit."""
    from source_patch.runtime.core.settings_doc import markdown

    assert (ROOT / "docs" / "settings.md").read_text() == markdown(), \
        "docs/settings.md is stale: run `source-patch settings --write docs/settings.md`"


def test_the_settings_page_names_every_key():
    from source_patch.runtime.core.settings import SCHEMAS
    from source_patch.runtime.core.settings_doc import markdown

    page = markdown()
    assert all(f"`SOURCE_PATCH_{c.upper()}_{k.upper()}`" in page for c, keys in SCHEMAS.items() for k in keys)
