"""source-patch: YAML patch specs applied with libcst at import time.

Public API (stable from spec format v1):

    activate(specs)            patch these specs' targets from their next import on
    patched(*specs)            the same as a context manager, for tests
    import_patched_copy(m, *s) a fresh patched copy of module m, sys.modules untouched
    load_spec(ref) / Spec      read and validate a spec file or bundled spec name

Importing this package imports neither libcst nor any target.  It imports nothing
at all until one of the names above is used (PEP 562): the start hook imports the
package in every process started with SOURCE_PATCH set, and its fast path
(boot.py) must not pay for dataclasses, typing, hashlib and the rest.
"""

# public name -> (submodule, attribute)
_EXPORTS = {
    "Activation": ("activation", "Activation"), "activate": ("activation", "activate"),
    "import_patched_copy": ("activation", "import_patched_copy"), "patched": ("activation", "patched"),
    "ActivationError": ("errors", "ActivationError"), "AnchorError": ("errors", "AnchorError"),
    "Location": ("errors", "Location"), "RequirementError": ("errors", "RequirementError"),
    "SourcePatchError": ("errors", "SourcePatchError"), "SpecError": ("errors", "SpecError"),
    "FORMAT_VERSION": ("spec", "FORMAT_VERSION"), "Edit": ("spec", "Edit"), "Patch": ("spec", "Patch"),
    "Spec": ("spec", "Spec"), "load_spec": ("spec", "load"),
}

__all__ = [
    "FORMAT_VERSION", "Activation", "ActivationError", "AnchorError", "Edit", "Location", "Patch",
    "RequirementError", "SourcePatchError", "Spec", "SpecError", "activate", "import_patched_copy",
    "load_spec", "patched",
]


def __getattr__(name: str):
    """A name of the API, imported on first use.  Submodules are not attributes until
    imported (``from source_patch.patcher import cache`` imports it, as for any package)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    module, attr = _EXPORTS[name]
    imported = import_module(f"{__name__}.{module}")
    value = getattr(imported, attr)
    if module == "activation":  # the API's first use: SOURCE_PATCH set too late is said here
        imported.warn_env_after_start()
    globals()[name] = value  # once
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
