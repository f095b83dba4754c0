"""The docs stay pages a reader can follow (issue 55, item 7): every page of docs/ (not
bench-notes/, the dated history) is under WORD_LIMIT words, and every place the code
names a docs page (``docs/weight_sync_backends.md``, ``docs/activation.md#the-code-cache``
in a docstring, a comment or a message) names a page and a heading that exist.

The links between pages (README.md and docs/, each ``[..](page.md#anchor)``) are checked
by tests/test_docs.py (``broken_links``); its GitHub anchor rule is checked here."""

import re
from pathlib import Path

from test_docs import _anchors, _slug, broken_links

ROOT = Path(__file__).parent.parent
WORD_LIMIT = 4500  # words as `wc -w` counts them; a page over ~4,000 is split by task
# Pages over the limit that are still to be split: each entry must still be over it (so
# it is removed once the page is split), with why it is here.
PENDING: dict = {}  # none left: dumps.md became dump.md, dump_files.md and dump_control.md
CODE = ("patcher", "runtime", "testing", "integrations", "patches", "bench", "examples")
SUFFIXES = {".py", ".js", ".yaml", ".yml", ".toml", ".sh", ".cpp", ".html"}
DOC_REF = re.compile(r"(?<![\w/.-])docs/([\w./-]+?\.md)(?:#([\w-]+))?")


def words(page: Path) -> int:
    return len(page.read_text().split())


def long_pages(pages, limit: int = WORD_LIMIT, pending: dict = PENDING) -> list:
    bad = [f"{p.name}: {words(p)} words, over {limit}: split it by task" for p in pages
           if words(p) > limit and p.name not in pending]
    names = {p.name: p for p in pages}
    bad += [f"{name}: listed as pending but " + ("not there" if name not in names else
            f"{words(names[name])} words, not over {limit}: drop it from PENDING")
            for name in pending if name not in names or words(names[name]) <= limit]
    return bad


def test_every_docs_page_is_under_the_word_limit():
    bad = long_pages(sorted((ROOT / "docs").glob("*.md")))
    assert not bad, "docs pages:\n" + "\n".join(bad)


def test_the_word_limit_check_can_fail(tmp_path):
    (tmp_path / "short.md").write_text("# Short\n" + "word " * 10)
    (tmp_path / "long.md").write_text("# Long\n" + "word " * 20)
    pages = sorted(tmp_path.glob("*.md"))
    assert long_pages(pages, limit=15, pending={}) == ["long.md: 22 words, over 15: split it by task"]
    assert long_pages(pages, limit=15, pending={"long.md": "later"}) == []
    assert long_pages(pages, limit=15, pending={"long.md": "", "short.md": "", "gone.md": ""}) == [
        "short.md: listed as pending but 12 words, not over 15: drop it from PENDING",
        "gone.md: listed as pending but not there"]


def code_doc_refs(root: Path = ROOT, dirs=CODE) -> list:
    """(file:line, page, anchor or None) for every ``docs/<page>.md[#anchor]`` in the code."""
    refs = []
    for folder in dirs:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in SUFFIXES or "__pycache__" in path.parts or not path.is_file():
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                refs += [(f"{path.relative_to(root)}:{n}", page, anchor) for page, anchor in DOC_REF.findall(line)]
    return [(where, page, anchor or None) for where, page, anchor in refs]


def broken_code_refs(root: Path = ROOT, dirs=CODE) -> list:
    bad = []
    for where, page, anchor in code_doc_refs(root, dirs):
        path = root / "docs" / page
        if not path.is_file():
            bad.append(f"{where}: docs/{page} (no such page)")
        elif anchor and anchor not in _anchors(path):
            bad.append(f"{where}: docs/{page}#{anchor} (no such heading)")
    return bad


def test_every_docs_page_the_code_names_exists():
    bad = broken_code_refs()
    assert not bad, "the code names docs that are not there:\n" + "\n".join(bad)


def test_the_code_reference_check_can_fail(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n## The code cache\n")
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "m.py").write_text(
        '"""See docs/a.md#the-code-cache and docs/a.md."""\n'
        "# docs/a.md#gone, docs/b.md, docs/bench-notes/c.md#x\n"
        'URL = "https://example.org/docs/z.md"  # not ours\n')
    assert broken_code_refs(tmp_path, ("runtime",)) == ["runtime/m.py:2: docs/a.md#gone (no such heading)",
                                                        "runtime/m.py:2: docs/b.md (no such page)",
                                                        "runtime/m.py:2: docs/bench-notes/c.md (no such page)"]


def test_anchors_follow_githubs_rule(tmp_path):
    """Lower case, spaces to '-', punctuation dropped but '-' and '_'."""
    assert _slug("Megatron-Core's own CUDA graphs (`cuda_graph_impl=\"local\"`)") == \
        "megatron-cores-own-cuda-graphs-cuda_graph_impllocal"
    assert _slug("Protocol (v2)") == "protocol-v2"
    assert _slug("on_drift: a patch whose anchor no longer matches") == "on_drift-a-patch-whose-anchor-no-longer-matches"
    assert _slug("Receiving an update: stage `update` and stage `bucket`") == \
        "receiving-an-update-stage-update-and-stage-bucket"
    (tmp_path / "p.md").write_text("# P\n## Activation: SOURCE_PATCH and the API\n```\n## not a heading\n```\n"
                                   "[ok](p.md#activation-source_patch-and-the-api) [code](p.md#not-a-heading)\n")
    assert broken_links([tmp_path / "p.md"], tmp_path) == ["p.md: p.md#not-a-heading (no such heading)"]
