"""docs/settings.md, generated from the settings schemas (``source-patch settings --write``),
so no capability page hand-copies its table and a test keeps the page current."""

from __future__ import annotations

import json

from .capability import capabilities

HEADER = """# Settings of the runtime's capabilities

Generated from the schemas each capability declares in its manifest
(`runtime/<capability>/manifest.py`) by
`source-patch settings --write docs/settings.md`; do not edit by hand (a test fails
when a schema changes without this page).

A value is taken, in order of precedence, from the environment
(`SOURCE_PATCH_<COMPONENT>_<KEY>`), then from the `runtime:` section of the active
specs (later specs win; a `component[distribution]:` section counts once a patch
requiring that distribution has applied), then from the default below. Each
capability's page says what the settings do together.

An environment value is checked against its schema when the specs are activated:
one that is refused stops the start-up with one line naming the variable, the value
and what is allowed (`SOURCE_PATCH_DUMP_PORT='abc': expected a port number 0-65535,
got 'abc'`; see [activation.md](activation.md#activation-source_patch-and-the-api)).
"""


def _default(value) -> str:
    if value is None or value == "":
        return "-"
    return f"`{json.dumps(value)}`" if not isinstance(value, str) else f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def as_json() -> dict:
    """Every setting as data (``source-patch settings --json``): component -> key ->
    variable, default (JSON), meaning; with each component's capability and page."""
    out = {}
    for cap in capabilities().values():
        for component, declared in sorted(cap.components.items()):
            out[component] = {"capability": cap.name, "page": f"docs/{cap.page}", "settings": {
                key: {"variable": f"SOURCE_PATCH_{component.upper()}_{key.upper()}", "default": setting.default,
                      "help": setting.help} for key, setting in declared.settings.items()}}
    return out


def markdown() -> str:
    parts = [HEADER]
    for cap in capabilities().values():
        for component, declared in sorted(cap.components.items()):
            parts.append(f"\n## `{component}`\n\n{cap.summary[0].upper()}{cap.summary[1:]} "
                         f"([{cap.page}]({cap.page})).\n\n"
                         "| key | environment | default | what it does |\n| --- | --- | --- | --- |")
            for key, setting in declared.settings.items():
                env = f"SOURCE_PATCH_{component.upper()}_{key.upper()}"
                parts.append(f"| `{key}` | `{env}` | {_cell(_default(setting.default))} | {_cell(setting.help)} |")
    return "\n".join(parts) + "\n"
