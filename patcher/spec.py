"""Spec format 1.1 (and 1): load a YAML patch spec into frozen dataclasses.

The YAML is composed into nodes (never constructed into arbitrary objects) so
every value keeps its line and column; every error names file:line:column and
the dotted field.  The format is documented field by field in docs/spec.md.
"""

from __future__ import annotations

import ast
import json
import keyword
import os
import re
from dataclasses import astuple, dataclass, field, fields
from pathlib import Path

from . import boot
from .boot import MAX_SPEC_BYTES, OLD_SPEC_NAMES, NotASpecFile, renamed
from .cache import CodeCache, spec_key
from .errors import Location, SpecError, shorten, show
from .patterns import parse_pattern

# PyYAML is imported by loads() on first use: a spec read before comes from the code
# cache (load), so a warm start-up never imports it.  The builder below runs only
# after loads() has bound these.
yaml = SafeConstructor = _Loader = None

# Limits on one spec, so that a valid but oversized one fails at once with its file and
# line instead of costing minutes at every cache miss: PyYAML composes ~5 us a byte of
# dense YAML, and the rewrite costs libcst ~0.1-0.3 ms per inserted syntax node (parse,
# transform, positions) and ~2 ms per edit.  The bundled specs use at most 38 edits,
# 600 syntax nodes of code and 511 YAML nodes.  MAX_SPEC_BYTES, the file's size, comes
# from boot.py: the start hook reads spec files too.
MAX_YAML_NODES = 50_000  # composed nodes, aliases included
MAX_EDITS = 1_000  # edits of all patches, an aliased list counted at each use
MAX_CODE_NODES = 20_000  # Python syntax nodes of all code and wrap fields, likewise
# Characters of all code and wrap fields (the bundled specs: at most 3,055), checked before
# any of it is parsed: Python's parser took 5.4 s and 0.7 GB on 1.8 MB of code before the
# node count could refuse it, PyYAML 4.2 s on the 4.8 MB file holding it (_code_blocks).
MAX_CODE_CHARS = 256 << 10


class _TooManyNodes(Exception):
    pass


def _import_yaml() -> None:
    global yaml, SafeConstructor, _Loader
    if yaml is None:
        import yaml as module
        from yaml.constructor import SafeConstructor as constructor

        class Loader(module.SafeLoader):
            """Stops composing past MAX_YAML_NODES, where that is (time and memory)."""

            nodes = 0

            def compose_node(self, parent, index):
                self.nodes += 1
                if self.nodes > MAX_YAML_NODES:
                    raise _TooManyNodes(self.peek_event().start_mark)
                return super().compose_node(parent, index)

        yaml, SafeConstructor, _Loader = module, constructor, Loader

FORMAT_VERSION = "1.1"
FORMAT_VERSIONS = ("1", "1.1")  # every format this loader reads; 1.1 only adds fields
DEFAULT_HANDLE = "__sp__"
DEFAULT_BIND = "result"
CALL_PLACEHOLDER = "__call__"
MODULE_TARGET = "<module>"  # target the module's top-level code

ANCHORS = ("entry", "return", "before", "after", "replace", "call")
# Keys each anchor kind accepts besides ``at`` (the first set is required).
_EDIT_KEYS = {
    "entry": ({"code"}, set()),
    "return": ({"code"}, {"bind", "count"}),
    "before": ({"match", "code"}, {"count"}),
    "after": ({"match", "code"}, {"count"}),
    "replace": ({"match", "code"}, {"count"}),
    "call": ({"match", "wrap"}, {"count"}),
}
_SPEC_KEYS = ({"source_patch", "name", "patches"},
              {"description", "handle", "requires", "on_unmet", "runtime"})
_PATCH_KEYS = ({"id", "module", "target", "edits"}, {"description", "requires", "on_drift"})
_NEW_IN_1_1 = {"requires", "on_drift"}  # patch keys a version-1 file may not use
ON_UNMET = ("error", "skip")
ON_DRIFT = ("error", "warn", "skip")
_SCOPED_RE = re.compile(r"([a-z_]+)\[([A-Za-z0-9][A-Za-z0-9._\-]*)\]\Z")  # runtime: dump[sglang]

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*\Z")
_DOTTED_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")
_TARGET_RE = re.compile(rf"{_DOTTED_RE.pattern}|<module>\Z")
BUNDLED_DIR = Path(boot.BUNDLED_DIR)


@dataclass(frozen=True)
class Edit:
    """One change inside a target function, at one kind of anchor."""

    at: str
    code: str = ""
    match: str = ""
    wrap: str = ""
    bind: str = DEFAULT_BIND
    count: int | None = 1  # None: one or more ("all")
    location: Location = field(default=Location(""), compare=False)

    def describe(self) -> str:
        return f"at {self.at} {show(self.match)}" if self.match else f"at {self.at}"


@dataclass(frozen=True)
class Patch:
    """Edits to one function or method (``target``) of one module."""

    id: str
    module: str
    target: str
    edits: tuple[Edit, ...]
    spec_name: str = ""
    handle: str = DEFAULT_HANDLE  # the name inserted code uses to reach the runtime
    description: str = ""
    requires: tuple[tuple[str, str], ...] = ()  # unmet: the patch is skipped (the spec's: on_unmet)
    on_drift: str = "error"
    location: Location = field(default=Location(""), compare=False)


@dataclass(frozen=True)
class Spec:
    name: str
    file: str
    patches: tuple[Patch, ...]
    handle: str = DEFAULT_HANDLE
    description: str = ""
    requires: tuple[tuple[str, str], ...] = ()
    on_unmet: str = "error"
    runtime_json: str = "{}"  # settings for runtime components, canonical JSON (hashable)
    location: Location = field(default=Location(""), compare=False)

    @property
    def modules(self) -> list[str]:
        return sorted({p.module for p in self.patches})

    @property
    def runtime(self) -> dict[str, dict]:
        """``{component: {key: value}}`` from the spec's ``runtime`` section."""
        return {k: v for k, v in json.loads(self.runtime_json).items() if "[" not in k}

    @property
    def scoped_runtime(self) -> dict[tuple[str, str], dict]:
        """``{(component, distribution): {key: value}}``: settings written
        ``component[distribution]``, which apply once a patch requiring that
        distribution has been applied in the process."""
        out = {}
        for key, values in json.loads(self.runtime_json).items():
            m = _SCOPED_RE.match(key)
            if m:
                out[m.group(1), m.group(2)] = values
        return out


# --------------------------------------------------------------------------- loading


def resolve(ref: str) -> Path:
    """A spec reference is a file path or the name of a bundled spec (``megatron_cpu``)."""
    try:
        path = Path(ref).expanduser()
        if path.suffix in (".yaml", ".yml") or os.sep in ref or path.exists():
            if path.stem in OLD_SPEC_NAMES and path.parent.resolve() == BUNDLED_DIR and not path.exists():
                return BUNDLED_DIR / f"{renamed('spec', path.stem)}.yaml"
            return path.resolve()
        bundled = BUNDLED_DIR / f"{renamed('spec', ref)}.yaml"
        if bundled.exists():
            return bundled
    except (OSError, RuntimeError, ValueError) as exc:  # name too long, ~nosuchuser, NUL
        raise SpecError(f"not a usable spec path: {_why(exc)}", Location(ref)) from None
    names = ", ".join(sorted(bundled_names())) or "none"
    raise SpecError(f"no spec file or bundled spec named {show(ref)} (bundled: {names})", Location(ref))


def bundled_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.yaml"))


def load(ref: str | os.PathLike) -> Spec:
    path = resolve(os.fspath(ref))
    return compiled(read_text(path), str(path))


def compiled(text: str, file: str, cache: CodeCache | None = None) -> Spec:
    """loads() through the code cache (``cache``, else the default one): a spec read
    before (the same text, file, tool and runtime schemas) is rebuilt from its stored
    form, without YAML, validation or their imports; an invalid spec is never stored,
    so its error is always fresh."""
    cache, k = cache or CodeCache(), spec_key(text, file)
    stored = cache.get_data(k)
    spec = None
    if stored is not None:
        try:
            spec = _rebuild(Spec, stored)
        except (TypeError, ValueError, IndexError):
            pass  # another layout: validate again
    if spec is None:
        spec = loads(text, file)
        cache.put(k, astuple(spec))
    # The key names the spec wholly (its text, file and this tool): the finder keys stat
    # entries by it.  Not a field, so dataclasses.replace() (another spec) drops it.
    object.__setattr__(spec, "cache_key", k)
    return spec


def settings_errors(environ) -> list[str]:
    """The ``SOURCE_PATCH_<COMPONENT>_<KEY>`` variables the settings schemas refuse, one
    line each: checked against the schemas that check a spec's ``runtime:`` section
    (activation.py asks here: the patcher reaches the schemas through this module)."""
    from source_patch.runtime.core import settings  # schemas only: no torch, no I/O

    return settings.environ_errors(environ)


def settings_variables() -> frozenset:
    """Every runtime setting's environment variable (``SOURCE_PATCH_DUMP_DIR``, ...):
    the names activation.py knows besides the patcher's own."""
    from source_patch.runtime.core import settings  # schemas only: no torch, no I/O

    return frozenset(settings.variable(component, key) for component, schema in settings.SCHEMAS.items()
                     for key in schema)


def _rebuild(cls, values: tuple):
    """A Spec (Patch, Edit) from dataclasses.astuple's nested tuples."""
    kw = {}
    for f, value in zip(fields(cls), values, strict=True):
        if f.name == "location":
            value = Location(*value)
        elif f.name in ("patches", "edits"):
            value = tuple(_rebuild(Patch if f.name == "patches" else Edit, v) for v in value)
        kw[f.name] = value
    return cls(**kw)


def read_text(path: Path) -> str:
    """A spec file's text (``boot.read_spec``: a regular file, size-limited, UTF-8)."""
    try:
        return boot.read_spec(path)
    except (NotASpecFile, OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read spec: {_why(exc)}", Location(str(path))) from None


def loads(text: str, file: str = "<string>") -> Spec:
    """Parse and validate spec text; ``file`` is used in error locations."""
    if len(text) > MAX_CODE_CHARS:  # only a text this long can hold too much code
        _code_blocks(text, file)
    _import_yaml()
    try:
        root = yaml.compose(text, Loader=_Loader)
    except _TooManyNodes as exc:
        mark = exc.args[0]
        raise SpecError(f"too large: more than {MAX_YAML_NODES:,} YAML nodes (a spec holds a few hundred)",
                        Location(file, mark.line + 1, mark.column + 1)) from None
    except yaml.MarkedYAMLError as exc:
        from .yaml_words import explain

        message, line, column = explain(exc, text)
        raise SpecError(f"invalid YAML: {shorten(message, 1000)}", Location(file, line, column)) from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise SpecError(f"invalid YAML: unacceptable character #x{char:04x}: {exc.reason}",
                        _at(file, text, exc.position)) from None
    except yaml.YAMLError as exc:
        raise SpecError(f"invalid YAML: {shorten(exc)}", Location(file, 1, 1)) from None
    except RecursionError:
        raise SpecError("invalid YAML: nested too deeply", Location(file, 1, 1)) from None
    except ValueError as exc:  # PyYAML's scanner calls chr() on a "\U" escape past U+10FFFF unchecked
        escape = next((m for m in re.finditer(r"\\U([0-9A-Fa-f]{8})", text) if int(m[1], 16) > 0x10FFFF), None)
        if escape is None:
            raise SpecError(f"invalid YAML: {shorten(exc)}", Location(file, 1, 1)) from None
        raise SpecError(f"invalid YAML: the escape {escape[0]} names no character (the last one is \\U0010FFFF)",
                        _at(file, text, escape.start())) from None
    return _Builder(file).spec(root)


_CODE_KEY = re.compile(r"([ \t]*(?:-[ \t]+)*)(code|wrap)[ \t]*:(?:[ \t]+|$)")


def _code_blocks(text: str, file: str) -> None:
    """Refuse, before YAML reads it, a text whose ``code:`` and ``wrap:`` values alone pass
    MAX_CODE_CHARS.  A value is the rest of its key's line and the lines indented deeper
    than the key, counted without their indentation and blank lines (one pass, no YAML):
    not more than the value (comments and quoted escapes aside), so a valid spec is not
    refused here; what this misses (a flow mapping, an alias) the exact count
    (_Builder.count_chars) refuses after YAML, still before Python's parser."""
    total, key = 0, None
    for number, line in enumerate(text.splitlines(), 1):
        body = line.lstrip(" \t")
        if key and (not body or len(line) - len(body) > key[1]):
            total += len(body) + 1 if body else 0
        else:
            match = _CODE_KEY.match(line)
            key = (number, match.end(1), match[2]) if match else None
            rest = line[match.end():].rstrip() if match else ""
            total += 0 if rest[:1] in ("|", ">") else len(rest)  # a block's indicator is no content
        if key and total > MAX_CODE_CHARS:
            raise SpecError(_too_much_code(), Location(file, key[0], key[1] + 1, key[2]))


def _too_much_code() -> str:
    return (f"too much inserted code: more than {MAX_CODE_CHARS >> 10} KiB in this spec's code "
            f"and wrap fields (the bundled specs hold at most 3 KiB)")


def _at(file: str, text: str, position: int) -> Location:
    """The line and column of character ``position`` of ``text``."""
    return Location(file, text.count("\n", 0, position) + 1, position - (text.rfind("\n", 0, position) + 1) + 1)


class _Builder:
    """Walks composed YAML nodes, validating as it goes."""

    def __init__(self, file: str):
        self.file = file
        self.version = FORMAT_VERSION
        self.edits = self.code_nodes = self.code_chars = 0  # so far, against the MAX_ limits

    def loc(self, node: yaml.Node | None, path: str) -> Location:
        if node is None:
            return Location(self.file, 1, 1, path)
        return Location(self.file, node.start_mark.line + 1, node.start_mark.column + 1, path)

    def fail(self, message: str, node: yaml.Node | None, path: str):
        raise SpecError(message, self.loc(node, path))

    # -- node helpers

    def mapping(self, node, path: str, keys: tuple[set, set] | None) -> dict[str, yaml.Node]:
        """A mapping's values by key; ``keys`` is (required, optional), None admits any key."""
        if not isinstance(node, yaml.MappingNode):
            self.fail(f"expected a mapping, got {_kind(node)}", node, path)
        required, optional = keys or (set(), set())
        out: dict[str, yaml.Node] = {}
        for key_node, value in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                self.fail("keys must be plain strings", key_node, path)
            key = key_node.value
            where = f"{path}.{shorten(key)}" if path else shorten(key)
            if key in out:
                self.fail(f"duplicate key {show(key)}", key_node, where)
            if keys and key not in required | optional:
                valid = ", ".join(sorted(required | optional))
                self.fail(f"unknown key {show(key)} (valid keys: {valid})", key_node, where)
            out[key] = value
        missing = sorted(required - out.keys())
        if missing:
            self.fail(f"missing required key {missing[0]!r}", node, path)
        return out

    def scalar(self, node, path: str, tag: str = "str"):
        if not isinstance(node, yaml.ScalarNode) or node.tag != f"tag:yaml.org,2002:{tag}":
            self.fail(f"expected {'a string' if tag == 'str' else 'an ' + tag}, got {_kind(node)}",
                      node, path)
        if tag == "int":
            try:
                return SafeConstructor().construct_yaml_int(node)
            except (ValueError, TypeError, IndexError):
                self.fail(f"not an integer: {show(node.value)}", node, path)
        return node.value

    def word(self, node, path: str, pattern: re.Pattern, what: str) -> str:
        value = self.scalar(node, path)
        if not pattern.match(value):
            self.fail(f"{what} expected, got {show(value)}", node, path)
        return value

    def python(self, node, path: str) -> str:
        """A string field holding Python source; syntax errors point into the YAML."""
        text = self.scalar(node, path)
        self.count_chars(text, node, path)
        tree, error, lineno = _parse(text)
        if error:
            if node.style == "|":  # a literal block: its lines are the YAML lines after the '|'
                line = node.start_mark.line + 1 + lineno
            else:  # folded or quoted text: lines do not correspond, point at the value
                line = node.start_mark.line + 1
            raise SpecError(f"invalid Python: {shorten(error)}",
                            Location(self.file, line, node.start_mark.column + 1, path))
        self.count_code(tree, node, path)
        return text

    def count_chars(self, text: str, node, path: str) -> None:
        """Add a code or wrap field's characters to the spec's total; past MAX_CODE_CHARS,
        fail here, before Python's parser sees it."""
        self.code_chars += len(text)
        if self.code_chars > MAX_CODE_CHARS:
            self.fail(_too_much_code(), node, path)

    def count_code(self, tree: ast.AST, node, path: str) -> None:
        """Add inserted code's syntax nodes to the spec's total; past MAX_CODE_NODES, fail here."""
        for _ in ast.walk(tree):
            self.code_nodes += 1
            if self.code_nodes > MAX_CODE_NODES:
                self.fail(f"too much inserted code: more than {MAX_CODE_NODES:,} Python syntax nodes "
                          f"in this spec's code and wrap fields", node, path)

    # -- the document

    def spec(self, root) -> Spec:
        if root is None:
            self.fail("the spec is empty", None, "")
        top = self.mapping(root, "", _SPEC_KEYS)
        self.version = self.format_version(top["source_patch"])
        name = self.word(top["name"], "name", _ID_RE, "a name of letters, digits, '_', '.', '-'")
        handle = DEFAULT_HANDLE
        if "handle" in top:
            handle = self.scalar(top["handle"], "handle")
            if not _is_name(handle):
                self.fail(f"a Python identifier expected, got {show(handle)}", top["handle"], "handle")
        on_unmet = "error"
        if "on_unmet" in top:
            on_unmet = self.scalar(top["on_unmet"], "on_unmet")
            if on_unmet not in ON_UNMET:
                self.fail(f"must be one of {', '.join(ON_UNMET)}", top["on_unmet"], "on_unmet")
        patches_node = top["patches"]
        if not isinstance(patches_node, yaml.SequenceNode) or not patches_node.value:
            self.fail("expected a non-empty list of patches", patches_node, "patches")
        requires = self.requires(top.get("requires"), "requires")
        patches, seen = [], {}
        for i, node in enumerate(patches_node.value):
            patch = self.patch(node, f"patches[{i}]", name, handle)
            if patch.id in seen:
                self.fail(f"duplicate patch id {show(patch.id)} (first at line {seen[patch.id]})",
                          node, f"patches[{i}].id")
            seen[patch.id] = patch.location.line
            patches.append(patch)
        return Spec(
            name=name, file=self.file, patches=tuple(patches), handle=handle,
            description=self.scalar(top["description"], "description") if "description" in top else "",
            requires=requires, on_unmet=on_unmet,
            runtime_json=self.runtime(top.get("runtime")), location=self.loc(root, ""),
        )

    def format_version(self, node) -> str:
        """``source_patch: 1`` or ``1.1`` (YAML reads 1.1 as a number: compare its text)."""
        if not isinstance(node, yaml.ScalarNode) or node.tag not in (
                "tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:str"):
            self.fail(f"expected a format version such as {FORMAT_VERSION}, got {_kind(node)}",
                      node, "source_patch")
        version = node.value.strip()
        version = {"1.0": "1"}.get(version, version)
        if version not in FORMAT_VERSIONS:
            self.fail(f"unsupported format version {shorten(version)} (this tool reads "
                      f"{', '.join(FORMAT_VERSIONS)})", node, "source_patch")
        return version

    def requires(self, node, path: str) -> tuple[tuple[str, str], ...]:
        if node is None:
            return ()
        from packaging.specifiers import InvalidSpecifier, SpecifierSet

        out = []
        for dist, value in self.mapping(node, path, None).items():
            spec = self.scalar(value, f"{path}.{shorten(dist)}")
            try:
                SpecifierSet(spec)
            except InvalidSpecifier:
                self.fail(f"invalid version specifier {show(spec)} (e.g. '>=0.16,<0.17')",
                          value, f"{path}.{shorten(dist)}")
            out.append((dist, spec))
        return tuple(out)

    def runtime(self, node) -> str:
        """Settings of runtime components, checked against the component's schema."""
        if node is None:
            return "{}"
        from source_patch.runtime.core import settings  # schemas only: no torch, no I/O

        out = {}
        self.mapping(node, "runtime", None)  # shape and duplicate checks
        for key_node, values in node.value:
            component, path = key_node.value, f"runtime.{shorten(key_node.value)}"
            scoped = _SCOPED_RE.match(component)
            if scoped and self.version == "1":
                self.fail("runtime settings for one distribution (component[distribution]) "
                          "need source_patch: 1.1", key_node, path)
            if scoped:
                component = scoped.group(1)
            component = renamed("settings", component)  # an old component name warns, and counts as the new
            if component not in settings.SCHEMAS:
                known = ", ".join(sorted(settings.SCHEMAS)) or "none"
                self.fail(f"unknown runtime component {show(component)} (known: {known})",
                          key_node, path)
            self.mapping(values, path, None)
            section = out[key_node.value.replace(scoped.group(1) if scoped else key_node.value, component, 1)] = {}
            for name_node, value_node in values.value:
                key = name_node.value
                try:
                    value = SafeConstructor().construct_object(value_node, deep=True)
                    section[key] = settings.check(component, key, value)
                except KeyError as exc:
                    self.fail(shorten(exc.args[0], 1000), name_node, f"{path}.{shorten(key)}")
                except (ValueError, TypeError, yaml.YAMLError) as exc:
                    self.fail(shorten(exc, 1000), value_node, f"{path}.{shorten(key)}")
        return json.dumps(out, sort_keys=True)

    def patch(self, node, path: str, spec_name: str, handle: str) -> Patch:
        keys = self.mapping(node, path, _PATCH_KEYS)
        for key_node, _ in node.value:
            if self.version == "1" and key_node.value in _NEW_IN_1_1:
                self.fail(f"{show(key_node.value)} on a patch needs source_patch: 1.1",
                          key_node, f"{path}.{key_node.value}")
        pid = self.word(keys["id"], f"{path}.id", _ID_RE, "an id of letters, digits, '_', '.', '-'")
        module = self.word(keys["module"], f"{path}.module", _DOTTED_RE, "a dotted module name")
        target = self.word(keys["target"], f"{path}.target", _TARGET_RE,
                           f"a function or Class.method name, or {MODULE_TARGET}")
        edits_node = keys["edits"]
        if not isinstance(edits_node, yaml.SequenceNode) or not edits_node.value:
            self.fail("expected a non-empty list of edits", edits_node, f"{path}.edits")
        edits = tuple(self.edit(n, f"{path}.edits[{i}]") for i, n in enumerate(edits_node.value))
        desc = self.scalar(keys["description"], f"{path}.description") if "description" in keys else ""
        requires = self.requires(keys.get("requires"), f"{path}.requires")
        on_drift = "error"
        if "on_drift" in keys:
            on_drift = self.scalar(keys["on_drift"], f"{path}.on_drift")
            if on_drift not in ON_DRIFT:
                self.fail(f"must be one of {', '.join(ON_DRIFT)}", keys["on_drift"], f"{path}.on_drift")
        return Patch(pid, module, target, edits, spec_name, handle, desc, requires, on_drift,
                     self.loc(node, path))

    def edit(self, node, path: str) -> Edit:
        self.edits += 1
        if self.edits > MAX_EDITS:
            self.fail(f"too many edits: more than {MAX_EDITS:,} in one spec", node, path)
        if not isinstance(node, yaml.MappingNode):
            self.fail(f"expected a mapping, got {_kind(node)}", node, path)
        at_node = next((v for k, v in node.value
                        if isinstance(k, yaml.ScalarNode) and k.value == "at"), None)
        if at_node is None:
            self.fail(f"missing required key 'at' (one of: {', '.join(ANCHORS)})", node, path)
        at = self.scalar(at_node, f"{path}.at")
        if at not in ANCHORS:
            self.fail(f"unknown anchor {show(at)} (one of: {', '.join(ANCHORS)})", at_node, f"{path}.at")
        required, optional = _EDIT_KEYS[at]
        keys = self.mapping(node, path, (required | {"at"}, optional))
        kw: dict = {"at": at, "location": self.loc(node, path)}
        if "code" in keys:
            kw["code"] = self.python(keys["code"], f"{path}.code")
        if "match" in keys:
            kw["match"] = self.pattern(keys["match"], f"{path}.match", at)
        if "wrap" in keys:
            kw["wrap"] = self.wrap(keys["wrap"], f"{path}.wrap")
        if "bind" in keys:
            kw["bind"] = self.scalar(keys["bind"], f"{path}.bind")
            if not _is_name(kw["bind"]):
                self.fail(f"a Python identifier expected, got {show(kw['bind'])}", keys["bind"], f"{path}.bind")
        if "count" in keys:
            kw["count"] = self.count(keys["count"], f"{path}.count")
        return Edit(**kw)

    def count(self, node, path: str) -> int | None:
        if isinstance(node, yaml.ScalarNode) and node.value == "all":
            return None
        if not isinstance(node, yaml.ScalarNode) or node.tag != "tag:yaml.org,2002:int":
            self.fail(f"expected a positive integer or 'all', got {_kind(node)}", node, path)
        value = self.scalar(node, path, "int")
        if value < 1:
            self.fail("expected a positive integer or 'all' (an anchor that may match nothing "
                      "would let a patch silently not apply)", node, path)
        return value

    def pattern(self, node, path: str, at: str) -> str:
        text = self.scalar(node, path).strip()
        loc = self.loc(node, path)
        try:
            parse_pattern(text, call=at == "call")
        except SyntaxError as exc:
            raise SpecError(f"invalid pattern: {shorten(exc.msg)}", loc) from None
        except (ValueError, RecursionError, MemoryError) as exc:
            raise SpecError(f"invalid pattern: {shorten(_describe(exc))}", loc) from None
        return text

    def wrap(self, node, path: str) -> str:
        text = self.scalar(node, path).strip()
        self.count_chars(text, node, path)
        tree, error, _ = _parse(text, mode="eval")
        if error:
            self.fail(f"invalid Python expression: {shorten(error)}", node, path)
        uses = sum(isinstance(n, ast.Name) and n.id == CALL_PLACEHOLDER for n in ast.walk(tree))
        if uses != 1:
            self.fail(f"the wrap expression must use the name {CALL_PLACEHOLDER} exactly once "
                      f"(it stands for the matched call), found {uses}", node, path)
        self.count_code(tree, node, path)
        return text


def _parse(text: str, mode: str = "exec") -> tuple[ast.AST | None, str, int]:
    """ast.parse with every failure as (None, message, line within text)."""
    try:
        return ast.parse(text, mode=mode), "", 0
    except SyntaxError as exc:
        return None, exc.msg, exc.lineno or 1
    except (ValueError, RecursionError, MemoryError) as exc:  # lone surrogates, absurd nesting
        return None, _describe(exc), 1


def _why(exc: BaseException) -> str:
    """An exception's reason without the (possibly huge) file name an OSError repeats."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return shorten(exc)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, (RecursionError, MemoryError)):
        return "nested too deeply"
    return str(exc)


def _is_name(text: str) -> bool:
    return text.isidentifier() and not keyword.iskeyword(text) and text not in ("None", "True", "False")


def _kind(node) -> str:
    if node is None:
        return "nothing"
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return {"null": "null", "bool": "a boolean", "int": "an integer", "float": "a number",
            "str": "a string"}.get(node.tag.rsplit(":", 1)[-1], f"a {node.tag}")
