"""The planned due call's compiled launch (native_launch.cpp), for the trace setting
``triton_launch`` (``auto``, the default, takes it where built; ``native`` asks for it).

Built on the machine that runs it, against its torch, by ``source-patch build-native``
(one compiler command: a C++ compiler, torch's and Python's headers, nothing
downloaded); a process only loads what was built (:func:`load`), it never compiles.
The build lands in ``$SOURCE_PATCH_NATIVE_DIR`` (default: ``~/.cache/source-patch/native``),
under a name that hashes the source, torch's version and Python's: a torch upgrade
needs a new build, and a stale one is never loaded.  It is private like the code cache:
a folder or library another user owns or can write, or a symbolic link, is refused
with one warning (the trace launches directly).

:func:`plan` works out a compiled Triton kernel's parameters (its signature without the
constants Triton specialised on, then its scratch pointers) and checks them against the
driver's own count and sizes (cuFuncGetParamInfo): a wrong layout would fault the device.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

from ..core import private

SOURCE = Path(__file__).with_name("native_launch.cpp")
_TYPES = {"i1": "i", "i8": "i", "i16": "i", "i32": "i", "u1": "i", "u8": "i", "u16": "i", "u32": "i",
          "i64": "l", "u64": "l"}  # Triton's integer types -> the slot's width (native_launch.cpp)
_loaded: list = []  # [module or None]: load() looks once


def module_name() -> str:
    import torch

    key = SOURCE.read_bytes() + f"|{torch.__version__}|{sys.version}".encode()
    return f"source_patch_native_launch_{hashlib.sha256(key).hexdigest()[:12]}"


def build_dir(name: str | None = None) -> Path:
    """The folder of the build named ``name`` (default: this source's, for this torch)."""
    return Path(_root()) / (name or module_name())


def _root() -> str:
    return os.environ.get("SOURCE_PATCH_NATIVE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                      "source-patch", "native")


# The build is executed by every trace-enabled process that finds it (``auto``, the
# default): its folders and file follow the code cache's trust rules (core/private.py,
# docs/activation.md#the-code-cache), or a library another user planted runs as this user.


def build(verbose: bool = False) -> Path:
    """Compile the launcher for this torch (~20 s, once) with one compiler command
    (``$CXX``, default ``c++``; no ninja); its library's path.  Compiled in a private
    temporary folder, then written privately (0700 folders, a 0600 file, each checked)
    under a temporary name and renamed: a process that loads it never sees half a library."""
    import subprocess
    import sysconfig
    import tempfile

    import torch
    from torch.utils import cpp_extension

    name, root = module_name(), _root()
    try:
        os.close(private.open_folder(root, (name,), create=True))  # refused now, not after a 20 s compile
    except OSError as exc:
        raise BuildError(_unusable(root, exc)) from None
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    with tempfile.TemporaryDirectory(prefix="source-patch-native-") as scratch:  # 0700, a fresh name
        partial = os.path.join(scratch, f"{name}.so")
        command = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC", str(SOURCE), "-o", partial,
                   f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
                   f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{sysconfig.get_paths()['include']}",
                   *(f"-I{path}" for path in cpp_extension.include_paths()),
                   *(f"-L{path}" for path in cpp_extension.library_paths()),
                   "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
        if verbose:
            print(" ".join(command), file=sys.stderr)
        try:
            done = subprocess.run(command, capture_output=True, text=True)
        except FileNotFoundError as exc:
            raise BuildError(f"no C++ compiler: {exc.filename} (set CXX)") from None
        if done.returncode:
            raise BuildError(f"{command[0]} exited {done.returncode}:\n{done.stderr.strip()[-4000:]}")
        try:
            with open(partial, "rb") as f:
                library = f.read()
            private.write_private(root, (name, f"{name}.so"), library)
        except OSError as exc:
            raise BuildError(_unusable(root, exc)) from None
    _loaded.clear()
    return build_dir(name) / f"{name}.so"


def _unusable(root: str, exc: OSError) -> str:
    """One line: why the build cannot be written under ``root``."""
    reason = str(exc) if isinstance(exc, private.Untrusted) else exc.strerror or str(exc)
    return f"cannot build into {root}: {reason}"


class BuildError(RuntimeError):
    """The native launch could not be compiled (the compiler's own words inside)."""


refused: str | None = None  # why load() refused the build it found (said once, on stderr)
_kept: dict = {}  # (device, inode) -> module: each library file loaded once (dlopen keeps it anyway)
_held: list = []  # the descriptors libraries were loaded through (see _import)


def load():
    """The built launcher module, or None where this torch has none built, or where the
    one built is refused: one warning, and the trace launches directly (what is on disk
    never raises here)."""
    if not _loaded:
        _loaded.append(_load(module_name(), _root()))
    return _loaded[0]


def _load(name: str, root: str):
    global refused
    refused = None
    try:
        folder = private.open_folder(root, (name,))  # every level checked, on its descriptor
    except private.Untrusted as exc:
        return _refuse(root, exc)
    except OSError:  # nothing built there (an unusable folder: build-native says why)
        return None
    try:
        fd = private.open_file(folder, f"{name}.so", f"its file {name}/{name}.so")
    except FileNotFoundError:
        return None
    except OSError as exc:  # a link, a FIFO, another user's file: never opened further
        return _refuse(root, exc)
    finally:
        os.close(folder)
    return _import(fd, name, root)


def _import(fd: int, name: str, root: str):
    """The module of the checked library open at ``fd``, loaded through the descriptor
    (/proc/self/fd/N), so that dlopen maps the very file checked, not what a name may
    point at by then."""
    st = os.fstat(fd)
    known = _kept.get((st.st_dev, st.st_ino))
    if known is not None:
        os.close(fd)
        return known
    path = f"/proc/self/fd/{fd}"
    if not os.path.exists(path):
        os.close(fd)
        return _refuse(root, "no /proc/self/fd here to load it through its checked descriptor")
    _held.append(fd)  # never closed: dlopen knows a library by this path (one whose init
    # then failed too), so the number must never name another file in this process
    try:
        loader = importlib.machinery.ExtensionFileLoader(name, path)  # (the path has no .so suffix to go by)
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - garbage, another ABI, a failing init: refused, said
        return _refuse(root, f"its file {name}/{name}.so does not load: {type(exc).__name__}: {exc}")
    _kept[(st.st_dev, st.st_ino)] = module
    return module


def _refuse(root: str, reason) -> None:
    """Say why the build under ``root`` is not loaded: once (load() looks once)."""
    global refused
    refused = f"{root}: {reason}".splitlines()[0][:500]
    print(f"source-patch: native launch refused: {refused}; launching directly instead", file=sys.stderr, flush=True)
    return None


def plan(kernel, grid: tuple, args: tuple, tensor, nbytes: int = 0, padded: int = 0):
    """A compiled launch of Triton's ``kernel(x, out, *args)`` on ``grid`` for ``tensor``'s
    layout (native_launch.cpp's plan), writing ``nbytes`` into a ring slice of ``padded``
    bytes, or None where the launcher is not built, the kernel's parameters are not the
    plain kind it handles, or the driver disagrees."""
    module = load()
    if module is None:
        return None
    try:
        types, values = _parameters(kernel, args)
    except (AttributeError, KeyError, TypeError, ValueError):  # another Triton: its own launch
        return None
    meta = kernel.metadata
    if types is None or getattr(meta, "num_ctas", 1) != 1 or _parameter_sizes(kernel.function) != \
            [8 if kind in "pl" else 4 for kind in types]:
        return None
    return module.plan(tensor, _driver_launch(), kernel.function, tuple(grid), 32 * meta.num_warps, meta.shared,
                       types, values, nbytes, padded)


def _parameters(kernel, args: tuple) -> tuple:
    """``(types, values)`` of the kernel's parameters after its first two (the input and
    output pointers), or ``(None, None)`` where one is not an integer or pointer."""
    src, meta = kernel.src, kernel.metadata
    where = {name: i for i, name in enumerate(src.fn.arg_names)}

    def position(key) -> int:
        return where[key] if isinstance(key, str) else key[0] if isinstance(key, tuple) else key

    signature = {position(key): kind for key, kind in src.signature.items()}
    constants = {position(key) for key in getattr(src, "constants", {})}
    kept = [i for i in sorted(signature) if signature[i] != "constexpr" and i not in constants]
    if kept[:2] != [0, 1] or not all(signature[i].startswith("*") or signature[i] in _TYPES for i in kept):
        return None, None
    scratch = sum(hasattr(meta, f"{kind}_scratch_size") for kind in ("global", "profile"))  # null pointers
    full = (None, None, *args)
    types = "".join("p" if signature[i].startswith("*") else _TYPES[signature[i]] for i in kept) + "p" * scratch
    return types, (*(full[i] for i in kept[2:]), *(None,) * scratch)


@functools.cache
def _libcuda():
    import ctypes

    return ctypes.CDLL("libcuda.so.1")


def _driver_launch() -> int:
    import ctypes

    return ctypes.cast(_libcuda().cuLaunchKernel, ctypes.c_void_p).value


def _parameter_sizes(function: int) -> list:
    """The byte size of each of a CUDA function's parameters, from the driver
    (cuFuncGetParamInfo, CUDA 12.4 and later); [] where it cannot tell."""
    import ctypes

    info = getattr(_libcuda(), "cuFuncGetParamInfo", None)
    if info is None:
        return []
    info.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    offset, size, sizes = ctypes.c_size_t(), ctypes.c_size_t(), []
    while len(sizes) < 256 and info(function, len(sizes), ctypes.byref(offset), ctypes.byref(size)) == 0:
        sizes.append(size.value)
    return sizes
