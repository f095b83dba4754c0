"""Settings of runtime components: their schemas, and where values come from.

Each capability declares its components' schemas in its manifest
(``runtime/<capability>/manifest.py``, see core/capability.py); ``SCHEMAS`` is read
from the manifests on first use.  A value is taken, in order of precedence, from the
environment (``SOURCE_PATCH_<COMPONENT>_<KEY>``), then from the ``runtime:`` section of
the active specs (later specs win; a ``component[distribution]`` section counts once a
patch requiring that distribution has applied), then from the schema's default.  This
module imports nothing heavy: the spec loader uses it to validate ``runtime:`` sections,
and the manifests use its parsers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Setting:
    default: Any
    parse: Callable[[Any], Any]  # raises ValueError/TypeError with a message for bad values
    help: str


def schemas() -> dict[str, dict[str, Setting]]:
    """component -> key -> Setting, from every capability's manifest (read once)."""
    found = globals().get("SCHEMAS")
    if found is None:
        from .capability import capabilities

        found = {component: declared.settings for cap in capabilities().values()
                 for component, declared in cap.components.items()}
        globals()["SCHEMAS"] = found  # later reads of settings.SCHEMAS find it without __getattr__
    return found


def __getattr__(name: str):
    if name == "SCHEMAS":  # PEP 562: the table is built on first use, not at import
        return schemas()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check(component: str, key: str, value: Any) -> Any:
    """The parsed value; KeyError naming the valid keys, or ValueError/TypeError."""
    schema = schemas()[component]
    if key not in schema:
        raise KeyError(f"unknown key {key!r} for runtime component {component!r} "
                         f"(valid keys: {', '.join(sorted(schema))})")
    return schema[key].parse(value)


def check_all(component: str, changes: dict) -> dict[str, Any]:
    """Every change parsed before any is applied (a capability's ``configure``): the
    first bad one raises as ``check`` does, and nothing has changed."""
    return {key: check(component, key, value) for key, value in changes.items()}


def resolve(component: str, environ=os.environ) -> dict[str, Any]:
    """Effective settings of a component: environment over specs over defaults."""
    schema = schemas()[component]
    values = {key: setting.default for key, setting in schema.items()}
    finder = _finder()
    for spec in finder.specs if finder else ():
        values.update(spec.runtime.get(component, {}))
        for (name, dist), scoped in spec.scoped_runtime.items():  # `dump[sglang]:` in a spec
            if name == component and dist in finder.applied_dists:
                values.update(scoped)
    for key in schema:
        raw = environ.get(variable(component, key))
        if raw is not None:
            values[key] = from_environ(component, key, raw)
    return values


def variable(component: str, key: str) -> str:
    """The environment variable of a setting: ``SOURCE_PATCH_DUMP_PORT``."""
    return f"SOURCE_PATCH_{component.upper()}_{key.upper()}"


def from_environ(component: str, key: str, raw: str) -> Any:
    """An environment value parsed; ValueError naming the variable, the value and what is allowed."""
    try:
        return check(component, key, raw)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{variable(component, key)}={raw!r}: {exc}") from None


def environ_errors(environ=os.environ) -> list[str]:
    """One line per ``SOURCE_PATCH_<COMPONENT>_<KEY>`` its schema refuses.  Activation
    checks them all (patcher/activation.py): a bad one is refused at start-up, not at a
    call site deep in the job."""
    errors = []
    for component, schema in schemas().items():
        for key in schema:
            raw = environ.get(variable(component, key))
            if raw is not None:
                try:
                    from_environ(component, key, raw)
                except ValueError as exc:
                    errors.append(str(exc))
    return errors


def _finder():
    import sys

    activation = sys.modules.get("source_patch.patcher.activation")
    return activation.installed_finder() if activation else None


# -- parsers shared by components


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (true/false, 1/0, yes/no, on/off), got {value!r}")


def integer(low: int | None = None) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError(f"expected an integer, got {type(value).__name__}")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
        if low is not None and number < low:
            raise ValueError(f"expected an integer >= {low}, got {number}")
        return number
    return parse


def choice(*options: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {value!r}")
        return value
    return parse


def redacted(config: dict) -> dict:
    """A copy of a component's configuration that is safe to show: no token value."""
    config = dict(config)
    if config.get("token"):
        config["token"] = "<set>"
    return config


def text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


# Parsers accept both the forms a spec or a JSON request gives (lists, ints, bools)
# and the comma-separated strings an environment variable gives.  Their outputs are
# JSON-serialisable (a spec keeps them as canonical JSON).


def listed(value: Any, what: str) -> list:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise TypeError(f"expected {what} (a list or a comma-separated string), got {type(value).__name__}")


def string_list(value: Any) -> list[str] | None:
    """A list of non-empty strings; None, '' and [] mean "no filter" (None)."""
    if value is None:
        return None
    out = []
    for item in listed(value, "strings"):
        if not isinstance(item, str):
            raise TypeError(f"expected strings, got {type(item).__name__} {item!r}")
        if item.strip():
            out.append(item.strip())
    return out or None


def int_filter(value: Any) -> list | None:
    """Non-negative integers and ranges: ``"0-3,7,10-"`` or ``[0, "2-5", 9]``.

    Canonical form: a list of ints and ``"lo-hi"`` / ``"lo-"`` strings (inclusive,
    ``lo-`` is open-ended).  None, '' and [] mean "no filter" (None).
    """
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    out: list = []
    for item in listed(value, "integers or ranges"):
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise TypeError(f"expected an integer or a range such as '0-3', got {type(item).__name__} {item!r}")
        if isinstance(item, int):
            if item < 0:
                raise ValueError(f"expected integers >= 0, got {item}")
            out.append(item)
            continue
        text_ = item.strip()
        low, dash, high = text_.partition("-")
        try:
            lo = int(low)
            hi = int(high) if high.strip() else None
        except ValueError:
            raise ValueError(f"expected an integer or a range such as '0-3' or '10-', got {item!r}") from None
        if lo < 0 or (hi is not None and hi < lo):
            raise ValueError(f"bad range {item!r}: expected 0 <= low <= high")
        if not dash:
            out.append(lo)
        else:
            out.append(f"{lo}-{'' if hi is None else hi}")
    return out or None


class IntSet:
    """Membership in a canonical int filter (settings.int_filter): ints and 'lo-hi' / 'lo-'."""

    __slots__ = ("ints", "ranges")

    def __init__(self, spec: list):
        self.ints = frozenset(i for i in spec if isinstance(i, int))
        self.ranges = []
        for item in spec:
            if isinstance(item, str):
                low, _, high = item.partition("-")
                self.ranges.append((int(low), int(high) if high else None))

    def __contains__(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, int):
            return False
        return value in self.ints or any(lo <= value and (hi is None or value <= hi) for lo, hi in self.ranges)


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
               "tib": 1 << 40}


def size(low: int = 0) -> Callable[[Any], int]:
    """A byte count: an integer, or a string with a binary unit ('512M', '2GiB', '64k')."""
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError(f"expected a byte count (e.g. 1073741824 or '1G'), got {type(value).__name__}")
        if isinstance(value, int):
            number = value
        else:
            raw = value.strip().lower().replace("_", "")
            digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz ")
            unit = raw[len(digits):].strip()
            if unit not in _SIZE_UNITS or not digits:
                raise ValueError(f"expected a byte count such as 1073741824, '512M' or '2GiB', got {value!r}")
            try:
                number = int(float(digits) * _SIZE_UNITS[unit])
            except (ValueError, OverflowError):  # 'nan', '1e400'
                raise ValueError(f"expected a byte count such as '512M', got {value!r}") from None
        if number < low:
            raise ValueError(f"expected a byte count >= {low}, got {number}")
        return number
    return parse


def seconds(positive: bool = False) -> Callable[[Any], float]:
    """A number of seconds: finite and >= 0, or (``positive``) > 0, infinity allowed."""
    def parse(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError(f"expected a number of seconds, got {type(value).__name__}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"expected a number of seconds, got {value!r}") from None
        if positive and not number > 0:
            raise ValueError(f"expected a positive number of seconds, got {value!r}")
        if not positive and (not number >= 0 or number == float("inf")):
            raise ValueError(f"expected a finite number of seconds >= 0, got {value!r}")
        return number
    return parse


def port(value: Any) -> int:
    try:
        number = integer(low=0)(value)
    except ValueError:
        number = -1  # not a number, or negative: said as the range below, with the value given
    if not 0 <= number <= 65535:
        raise ValueError(f"expected a port number 0-65535, got {value!r}")
    return number


def nonempty_text(value: Any) -> str:
    if not text(value).strip():
        raise ValueError("expected a non-empty string")
    return value.strip()
