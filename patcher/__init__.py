"""source-patch: YAML patch specs applied with libcst at import time.

Public API (stable from spec format v1):

    activate(specs)            patch these specs' targets from their next import on
    patched(*specs)            the same as a context manager, for tests
    import_patched_copy(m, *s) a fresh patched copy of module m, sys.modules untouched
    load_spec(ref) / Spec      read and validate a spec file or bundled spec name

Importing this package imports neither libcst nor any target.
"""

from .activation import Activation, activate, import_patched_copy, patched
from .errors import (ActivationError, AnchorError, Location, RequirementError, SourcePatchError,
                     SpecError)
from .spec import FORMAT_VERSION, Edit, Patch, Spec
from .spec import load as load_spec

__all__ = [
    "FORMAT_VERSION", "Activation", "ActivationError", "AnchorError", "Edit", "Location", "Patch",
    "RequirementError", "SourcePatchError", "Spec", "SpecError", "activate", "import_patched_copy",
    "load_spec", "patched",
]
