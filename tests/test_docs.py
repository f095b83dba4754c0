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


CELL_MAX = 300  # characters: docs/benchmarks.md is a summary, the history is in bench-notes/


def benchmark_table_problems(page: Path, root: Path = ROOT) -> list:
    """docs/benchmarks.md (issue 55, item 7): one table, one row per goal; no cell over
    CELL_MAX characters; every row links to a bench script under bench/ and a page of
    docs/bench-notes/ that exist (the anchors are the link check's)."""
    lines = [line.strip() for line in page.read_text().splitlines() if line.lstrip().startswith("|")]
    rules = [line for line in lines if re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line)]
    if len(rules) != 1:
        return [f"{len(rules)} tables, not one"]
    bad = []
    for line in lines[lines.index(rules[0]) + 1:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line[1:-1])]
        name = cells[0][:60]
        bad += [f"{name}: a cell of {len(c)} characters" for c in cells if len(c) > CELL_MAX]
        targets = [(page.parent / t.partition("#")[0]).resolve() for t in LINK.findall(line)
                   if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
        found = [t for t in targets if t.exists()]
        if not any(t.parent == (root / "bench").resolve() and t.suffix == ".py" for t in found):
            bad.append(f"{name}: no link to a bench script")
        if not any(t.parent == (root / "docs" / "bench-notes").resolve() and t.suffix == ".md" for t in found):
            bad.append(f"{name}: no link to a bench-notes page")
    return bad


def test_the_benchmarks_page_is_one_row_per_goal():
    bad = benchmark_table_problems(ROOT / "docs" / "benchmarks.md")
    assert not bad, "docs/benchmarks.md:\n" + "\n".join(bad)


def test_the_benchmarks_check_can_fail(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "b.py").write_text("")
    (tmp_path / "docs" / "bench-notes").mkdir(parents=True)
    (tmp_path / "docs" / "bench-notes" / "b.md").write_text("# B\n")
    page = tmp_path / "docs" / "benchmarks.md"
    ok = "| ok | [b.py](../bench/b.py), [notes](bench-notes/b.md#b) |"
    page.write_text(f"| goal | links |\n| --- | --- |\n{ok}\n")
    assert benchmark_table_problems(page, tmp_path) == []
    page.write_text(f"| goal | links |\n| --- | --- |\n{ok}\n| {'x' * 301} | [gone](bench-notes/c.md) |\n")
    assert benchmark_table_problems(page, tmp_path) == [f"{'x' * 60}: a cell of 301 characters",
                                                        f"{'x' * 60}: no link to a bench script",
                                                        f"{'x' * 60}: no link to a bench-notes page"]
    page.write_text(f"| a |\n| --- |\n{ok}\n\n| b |\n| --- |\n{ok}\n")
    assert benchmark_table_problems(page, tmp_path) == ["2 tables, not one"]


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


def test_the_renamed_names_table_is_the_code_s():
    """docs/architecture.md's "Renamed names" shows patcher/boot.py's RENAMED, the one
    table of renamed user-facing names, and nothing else."""
    from source_patch.patcher.boot import RENAMED

    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Renamed names", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    shown = set()
    for row in rows:
        _, old, new = (re.findall(r"`([^`]+)`", cell) for cell in row.strip("|").split("|"))
        assert len(old) == len(new), row
        shown |= set(zip(old, new))
    assert shown == {(old, new) for (_, old), new in RENAMED.items()}
