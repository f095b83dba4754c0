"""The libcst anchor engine: locate every edit of a module, then rewrite it.

``rewrite(source, patches, ...)`` returns a code object compiled from the patched
source whose line numbers are remapped to the original file: every original
line keeps its number, and inserted code reports the line of its anchor.  All
edits of a patch are located and counted before any is applied, so a patch
applies whole or not at all; a patch that no longer matches stops the module
(``on_drift: error``) or is left out while the others apply (``warn``, ``skip``).
Inserted statements run inside ``try``, whose handler adds a PEP 678 note naming
the spec, patch and YAML line to any exception they raise (free until one does).

Only the defs the patches target are parsed and rewritten (``_rewrite_regions``);
the whole module is, where that path cannot be sure to give the same result, and
to build every error.

The rewrite, by module (each imports only those above it):

    anchors.py    where each edit goes: targets, scopes, pattern matches, the plan; drift in words
    transform.py  the libcst transformer that carries out a plan
    linemap.py    patched line -> original line, and the ast that carries it
    regions.py    the region path: only the targeted defs, spliced into the untouched text
    engine.py     rewrite(): the region path, else the whole module; the outcome

These modules import libcst; the loader imports them only on a cache miss.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Callable, Sequence

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from .anchors import _handle_problems, _Locator, _Plan
from .errors import AnchorError
from .linemap import _line_map, _remap
from .regions import rewrite_regions
from .spec import Edit, Patch
from .transform import _Transformer


@dataclass
class Rewritten:
    """The outcome of patching one module."""

    source: str  # the patched source text (for diffs)
    tree: ast.Module  # its ast, line numbers already mapped to the original file
    line_map: list[int]  # patched line -> original line (index 0 unused)
    hits: list[tuple[Patch, Edit, list[int]]]  # each edit with the original lines it matched
    dropped: list[tuple[Patch, AnchorError]] = field(default_factory=list)  # drifted, on_drift warn|skip


_REGIONS = True  # private switch: False forces the whole-module path (tests compare the two)


def rewrite(source: str, patches: Sequence[Patch], *, module: str, file: str,
            version: Callable[[], str] = lambda: "unknown version",
            regions: bool | None = None) -> Rewritten:
    if _REGIONS if regions is None else regions:
        done = _rewrite_regions(source, patches, file)
        if done is not None:
            return done
    return _rewrite_module(source, patches, module=module, file=file, version=version)


def _rewrite_module(source: str, patches: Sequence[Patch], *, module: str, file: str,
                    version: Callable[[], str]) -> Rewritten:
    """The whole-module path: parse, locate, transform and line-map the entire file."""
    tree = cst.parse_module(source)
    wrapper = MetadataWrapper(tree, unsafe_skip_copy=True)
    positions = wrapper.resolve(PositionProvider)
    locator = _Locator(tree, positions)
    plan, problems, dropped = _Plan(), [], []
    problems += _handle_problems(source, patches)
    for patch in patches:
        own = _Plan()
        drift = locator.plan_patch(patch, own)
        if drift and patch.on_drift != "error":
            dropped.append((patch, AnchorError(module, file, version(), drift)))
            continue
        problems += drift
        problems += [f"  line {locator.line(plan.replace[k][0])} is replaced by two patches "
                     f"(one is {patch.id!r}); only one edit may replace a statement"
                     for k in plan.merge(own)]
    problems += locator.replace_conflicts(plan)
    if problems:
        raise AnchorError(module, file, version(), problems)
    transformer = _Transformer(plan, positions)
    new_tree = tree.visit(transformer)
    line_map = _line_map(new_tree, positions, transformer.origin, transformer.inserted)
    patched = new_tree.code
    return Rewritten(patched, _remap(patched, source, file, line_map), line_map, plan.hits, dropped)


def _rewrite_regions(source: str, patches: Sequence[Patch], file: str) -> Rewritten | None:
    """The region path (regions.py), its ast remapped to the original file; None: it
    cannot be sure to match the whole-module path, which must run."""
    done = rewrite_regions(source, patches)
    if done is None:
        return None
    patched, line_map, hits = done
    return Rewritten(patched, _remap(patched, source, file, line_map), line_map, hits, [])
