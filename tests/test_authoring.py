"""`source-patch anchors` and `source-patch new`: patcher.authoring."""

import ast
import json
import re
import textwrap

import pytest
import yaml

from source_patch.patcher import spec as spec_module
from source_patch.patcher.authoring import anchors, skeleton
from source_patch.patcher.engine import rewrite
from source_patch.patcher.errors import SourcePatchError
from source_patch.patcher.patterns import Pattern, parse_pattern

MOD = '''\
"""A fixture module: never imported, only read."""

import torch

LIMIT = 4


def route(scores, n):
    """Pick experts."""
    total = 0
    for i in range(n):
        total += i
    total = 0
    if n > 2:
        kind = "many"
    elif n == 2:
        kind = "two"
    else:
        kind = "few"
    top = torch.topk(scores, k=2)
    weights = normalize(scores, "an argument string long enough to run past sixty characters")
    result = combine(
        top,
        kind,  # a comment inside the call
    )

    def helper(x):
        return x + 1

    if total:
        return top, kind
    return helper(total), weights, result


class Router:
    def __init__(self):
        self.k = 2

    def forward(self, x):
        return x
'''


@pytest.fixture
def pkg(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text(MOD)
    return str(tmp_path)


def rows(text: str) -> list[tuple[str, int, str, int]]:
    """(section, line, pattern, count) of every quoted pattern printed."""
    out, section = [], ""
    for line in text.splitlines():
        if not line.startswith(" "):
            section = line.split()[0]
            continue
        number, _, rest = line.strip().partition("  ")
        if not rest.startswith('"'):
            continue  # a note such as the docstring's
        pattern, end = json.JSONDecoder().raw_decode(rest)
        count = re.search(r"# matches (\d+) ", rest[end:])
        out.append((section, int(number), pattern, int(count.group(1)) if count else 1))
    return out


def test_lists_the_statements_calls_and_returns_of_the_function_itself(pkg):
    text = anchors("pkg.mod:route", against=pkg)
    lines = text.splitlines()
    assert lines[0].endswith("pkg/mod.py: route (lines 8-32)")
    assert lines[1:] == [
        "statements (at: before | after | replace):",
        "   9  # docstring (at: entry goes after it)",
        '  10  "total = 0"   # matches 2 statements: use count: 2 or a more specific pattern',
        '  11  "for i in range(n):"',
        '  12  "total += i"',
        '  13  "total = 0"   # matches 2 statements: use count: 2 or a more specific pattern',
        '  14  "if n > 2:"',
        '  15  "kind = \\"many\\""',
        '  17  "kind = \\"two\\""',
        '  19  "kind = \\"few\\""',
        '  20  "top = torch.topk(scores, k=2)"',
        '  21  "weights = normalize(...)"',  # long arguments
        '  22  "result = combine(...)"',  # arguments over several lines
        '  27  "def helper(x):"',  # the nested def is a statement; its body is not searched
        '  30  "if total:"',
        '  31  "return top, kind"',
        '  32  "return helper(total), weights, result"',
        "calls (at: call):",
        '  11  "range(n)"',
        '  20  "torch.topk(scores, k=2)"',
        '  21  "normalize(...)"',
        '  22  "combine(...)"',
        '  32  "helper(total)"',
        "returns (at: return, count: 2):",
        '  31  "return top, kind"',
        '  32  "return helper(total), weights, result"',
    ]


def own_code(line: int, call: bool) -> list[str]:
    """The source of each statement (or call) of the fixture that starts on ``line``."""
    kind = ast.Call if call else ast.stmt
    # A statement's first line is padded so that its body stays consistently indented.
    return [textwrap.dedent(ast.get_source_segment(MOD, n, padded=not call))
            for n in ast.walk(ast.parse(MOD)) if isinstance(n, kind) and n.lineno == line]


def test_every_pattern_parses_matches_its_line_and_lands_there_when_pasted(pkg):
    found = rows(anchors("pkg.mod:route", against=pkg))
    assert len(found) == 22
    edits = []
    for section, line, pattern, count in found:
        call = section == "calls"
        parse_pattern(pattern, call=call)
        assert any(Pattern(pattern, call=call).matches(code) for code in own_code(line, call)), \
            (line, pattern, own_code(line, call))
        action = 'wrap: "(__call__)"' if call else "code: pass"
        edits.append(f"{{at: {'call' if call else 'before'}, match: {json.dumps(pattern)}, "
                     f"count: {count}, {action}}}")
    # Pasted into a spec as printed, with the count printed, each lands on its line.
    spec = spec_module.loads("source_patch: 1\nname: a\npatches:\n  - id: p\n    module: pkg.mod\n"
                             "    target: route\n    edits:\n" + "".join(f"      - {e}\n" for e in edits))
    result = rewrite(MOD, spec.patches, module="pkg.mod", file="mod.py")
    assert [line in hit_lines for (_, line, _, _), (_, _, hit_lines) in zip(found, result.hits)] \
        == [True] * len(found)


def test_patterns_are_quoted_for_yaml(pkg):
    line = next(t for t in anchors("pkg.mod:route", against=pkg).splitlines()
                if t.startswith("  15"))
    assert yaml.safe_load("m: " + line.split("  ", 2)[2]) == {"m": 'kind = "many"'}


def test_the_module_level_target(pkg):
    text = anchors("pkg.mod:<module>", against=pkg)
    assert text.splitlines()[1:] == [
        "statements (at: before | after | replace):",
        "   1  # docstring (at: entry goes after it)",
        '   3  "import torch"',
        '   5  "LIMIT = 4"',
        '   8  "def route(scores, n):"',
        '  35  "class Router:"',
        "calls: none",
        "returns: none (use at: after on the last statement)",
    ]


def test_a_class_lists_its_methods(pkg):
    text = anchors("pkg.mod:Router", against=pkg)
    assert text.splitlines()[1:] == [
        "methods (target one as Router.NAME):",
        "  36  Router.__init__",
        "  39  Router.forward",
    ]
    assert '"self.k = 2"' in anchors("pkg.mod:Router.__init__", against=pkg)


def test_a_misspelled_target_names_the_nearest(pkg):
    with pytest.raises(SourcePatchError, match=r"target 'rout' not found .*nearest: route"):
        anchors("pkg.mod:rout", against=pkg)


def test_a_target_without_a_module_is_refused(pkg):
    with pytest.raises(SourcePatchError, match="expected MODULE:QUALNAME"):
        anchors("route", against=pkg)


def test_what_no_pattern_can_match_gets_a_note(tmp_path):
    (tmp_path / "t.py").write_text("def f(a):\n    try:\n        g()\n    except E:\n        pass\n"
                                   "    return f(a.b()\n             .c())\n")
    text = anchors("t:f", against=str(tmp_path))
    assert "  2  # no pattern can match this statement; anchor on one inside it\n  3  \"g()\"" in text
    # `a.b()\n.c()` does not parse on its own, so no call pattern can reach it.
    assert "  6  # no pattern can match this call; anchor on its statement\n  6  \"a.b()\"" in text
    assert '  6  "return f(...)"' in text


def test_a_real_megatron_function():
    text = anchors("megatron.core.transformer.moe.moe_utils:topk_routing_with_score_function")
    statements = text[text.index("statements ("):text.index("calls (")]
    assert re.search(r'^ +\d+  "routing_map = routing_map\.bool\(\)"$', statements, re.M)
    assert "\nreturns (at: return, count: 2):\n" in text
    assert '"_, top_indices = compute_topk(scores_for_routing, topk, num_groups, group_topk)"' in text


# --------------------------------------------------------------------------- new


def test_the_skeleton_is_yaml_with_the_1_1_fields():
    text = skeleton("my-spec")
    data = yaml.safe_load(text)
    assert data["source_patch"] == 1.1 and data["name"] == "my-spec"
    (patch,) = data["patches"]
    assert patch["module"] == "your_package.your_module" and patch["target"] == "your_function"
    assert "requires" not in patch and patch["on_drift"] == "error"  # unknown module: none derived
    (edit,) = patch["edits"]
    assert edit["at"] == "entry"
    ast.parse(edit["code"])
    for word in ("at: entry", "at: return", "at: before", "at: after", "at: call", "at: replace",
                 "docs/spec.md", "# requires:", "warn (skip this patch, warn) | skip", "#edits"):
        assert word in text


def test_the_skeleton_takes_module_and_target():
    data = yaml.safe_load(skeleton("s", module="a.b", target="C.__init__"))
    assert (data["patches"][0]["module"], data["patches"][0]["target"]) == ("a.b", "C.__init__")
    data = yaml.safe_load(skeleton("s", module="a.b", target="<module>"))
    assert data["patches"][0]["target"] == "<module>" and data["patches"][0]["id"] == "module"


def test_the_skeleton_refuses_a_name_the_spec_would_refuse_and_quotes_one_yaml_would_misread():
    with pytest.raises(SourcePatchError, match="spec name"):
        skeleton("bad name: x")
    assert yaml.safe_load(skeleton("1.1", target="yes"))["name"] == "1.1"
    assert yaml.safe_load(skeleton("1.1", target="yes"))["patches"][0]["id"] == "yes"


def test_the_skeleton_loads_with_the_spec_loader():
    if str(spec_module.FORMAT_VERSION) == "1":
        pytest.skip("spec 1.1 not yet in the loader")
    spec = spec_module.loads(skeleton("my-spec", module="a.b", target="f"))
    (patch,) = spec.patches
    assert (spec.name, patch.module, patch.target, patch.on_drift) == ("my-spec", "a.b", "f", "error")
    assert patch.requires == ()  # a.b: no distribution known, none derived
    assert [e.at for e in patch.edits] == ["entry"]


def test_the_cli_writes_a_skeleton_once_and_lists_anchors(tmp_path, capsys, monkeypatch):
    from source_patch.patcher import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["new", "probe", "--module", "spfix.basic", "--target", "add"]) == 0
    from source_patch.runtime.core.commands import command

    assert capsys.readouterr().out == f"wrote probe.yaml; check it with: {command('check', 'probe.yaml')}\n"
    assert "target: add" in (tmp_path / "probe.yaml").read_text()
    assert cli.main(["new", "probe"]) == 2  # never overwrites
    assert "probe.yaml exists; choose another name or -o FILE" in capsys.readouterr().err
    assert cli.main(["anchors", "spfix.basic:add"]) == 0
    out = capsys.readouterr().out
    assert '  10  "total = a + b"' in out and '  11  "return total"' in out
