"""Do the call sites run the same code as at another revision?  (issue 55, item 8)

For every ``__sp__`` name a capability's manifest declares, and core's (the facade's
CORE), the function's compiled code here and at ``--against REV`` (git) is compared:
its instructions, the names and constants it uses, nested code included, line numbers
left out.  Nothing is imported: each module's source is compiled as text, so two
revisions sit side by side in one process.  A name whose module moved (``core/graph_stage.py``
to ``core/adapters/graph_stage.py``) is found under its old path by the same name.

    python bench/call_site_code.py --against HEAD~3      # exit 1 if a call site changed
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path
from types import CodeType

ROOT = Path(__file__).resolve().parents[1]


def call_sites() -> dict[str, str]:
    """``__sp__`` name -> its module's file, relative to the repository (this tree's manifests)."""
    sys.path.insert(0, str(ROOT.parent))
    from source_patch.runtime import facade

    return {name: "runtime/" + module.replace(".", "/") for name, module in facade.exports().items()}


def _source(path: str, rev: str | None) -> str | None:
    """The module's text here (rev None) or at ``rev``: ``path.py``, else ``path/__init__.py``."""
    for candidate in (f"{path}.py", f"{path}/__init__.py"):
        if rev is None:
            file = ROOT / candidate
            if file.is_file():
                return file.read_text()
            continue
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{candidate}"], capture_output=True,
                               text=True)
        if shown.returncode == 0:
            return shown.stdout
    return None


def _old_paths(rev: str) -> list[str]:
    """Every runtime module at ``rev`` (to find a function whose module moved)."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", rev, "runtime"],
                            capture_output=True, text=True, check=True).stdout.split()
    return [p.removesuffix(".py") for p in listed if p.endswith(".py")]


def _function(source: str, name: str) -> CodeType | None:
    """The code of the module-level function ``name`` in ``source`` (compiled, not run),
    docstrings left out: a comment's words are not what a call runs."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    module = compile(tree, "<call site>", "exec")
    return next((c for c in module.co_consts if isinstance(c, CodeType) and c.co_name == name), None)


def shape(code: CodeType) -> tuple:
    """What a code object runs, without where its lines are."""
    consts = tuple(shape(c) if isinstance(c, CodeType) else repr(c) for c in code.co_consts)
    return code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, consts


def _instructions(code: CodeType) -> tuple:
    """The instructions alone, nested code included (names and constants left out)."""
    return code.co_code, tuple(_instructions(c) for c in code.co_consts if isinstance(c, CodeType))


def _verdict(before: CodeType | None, now: CodeType) -> str:
    if before is None:
        return "new"
    if shape(before) == shape(now):
        return "same"
    if _instructions(before) == _instructions(now):
        return "same instructions (a name or constant differs)"
    return "changed"


def compare(rev: str) -> list[tuple[str, str]]:
    """(name, verdict) per call site: same, changed, new, or not a function (an alias)."""
    rows, old_paths = [], None
    for name, path in sorted(call_sites().items()):
        here = _source(path, None)
        now = _function(here, name) if here else None
        if now is None:
            rows.append((name, "not a def here (an alias or a re-export)"))
            continue
        before = _function(_source(path, rev) or "", name)
        if before is None:  # moved: look for the same name in every module at rev
            old_paths = old_paths if old_paths is not None else _old_paths(rev)
            found = [_function(_source(p, rev) or "", name) for p in old_paths
                     if f"def {name}(" in (_source(p, rev) or "")]
            before = next((c for c in found if c is not None), None)
        rows.append((name, _verdict(before, now)))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, metavar="REV", help="a git revision, e.g. HEAD~3")
    args = parser.parse_args(argv)
    rows = compare(args.against)
    width = max(len(name) for name, _ in rows)
    for name, verdict in rows:
        print(f"{name:<{width}}  {verdict}")
    changed = [name for name, verdict in rows if verdict == "changed"]
    same = sum(verdict.startswith("same") for _, verdict in rows)
    print(f"\n{same} of {len(rows)} call sites run the same code as at {args.against}; "
          f"changed: {', '.join(changed) or 'none'}")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
