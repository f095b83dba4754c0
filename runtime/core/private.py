"""Every file source-patch writes, written one way; and the trusted folders it reads back.

Two kinds of file:

- **private** files: what another user must neither read nor replace (the code cache's
  entries and boot records, the native build, the dump endpoint's and trace hub's
  URL + token files).  The folders that hold them are made 0700 whatever the umask and,
  like the file, checked on their descriptors on every read and write: owned by this
  user, not writable by group or others, no symbolic link below the chosen root.
- **plain** files: outputs at a path the user named (reports, merged routes, settings).
  They keep the umask's mode; an existing target must be a regular file (a FIFO, a
  device or a folder is refused at once instead of hanging or being replaced).

Both are written as a temporary file opened ``O_CREAT|O_EXCL|O_NOFOLLOW`` next to the
target (a name planted in advance, or a symbolic link at it, makes the open fail: it is
never followed, truncated or reused), flushed to disk, then renamed over the target, so
a reader sees the old file or the new one, never a part.

Light on purpose: the start hook (patcher/boot.py) imports it (os and stat only).
"""

from __future__ import annotations

import errno
import os
import stat

_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_AT = os.open in os.supports_dir_fd and os.rename in os.supports_dir_fd  # POSIX (os.replace too)


class Untrusted(OSError):
    """A folder or file that another user could have written (its reason)."""


def foreign(st, what: str) -> str | None:
    """Why a folder or file another user could have written must not be trusted (None: it may)."""
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{what} is owned by uid {st.st_uid}, not by this user ({os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def open_folder(root: str, parts, create: bool = False, check_root: bool = True) -> int:
    """A descriptor of the folder ``root/parts...``: each folder opened, then checked
    on its descriptor (the root too, unless ``check_root``: a folder the user chose);
    none below the root may be a symbolic link.  ``create``: a missing folder is made
    0700 (the root's parents with the usual modes)."""
    if not _AT:
        raise OSError("no directory descriptors here: private files are not written")
    fd = _open_dir(root, None, create, "it", check_root)
    try:
        for i, part in enumerate(parts):
            sub = _open_dir(part, fd, create, "its folder " + "/".join(parts[:i + 1]))
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_dir(name: str, at: int | None, create: bool, what: str, check: bool = True) -> int:
    flags = _READ | getattr(os, "O_DIRECTORY", 0) | (_NOFOLLOW if at is not None else 0)  # the root may be a link
    try:
        fd = os.open(name, flags, dir_fd=at)
    except FileNotFoundError:
        if not create:
            raise
        fd = _make_dir(name, at, flags, check)
    except OSError as exc:  # the root unreachable (a file on its path)
        raise (refusal(exc, what) if at is not None else exc) from None
    reason = foreign(os.fstat(fd), what) if check else None
    if reason:
        os.close(fd)
        raise Untrusted(reason)
    return fd


def _make_dir(name: str, at: int | None, flags: int, private: bool) -> int:
    """Make the missing folder ``name`` (0700 where ``private``: exactly, whatever the
    umask; else a root the user chose, with its parents, in the usual modes), opened."""
    if not private:
        os.makedirs(name, exist_ok=True)
        return os.open(name, flags, dir_fd=at)
    if at is None:
        os.makedirs(os.path.dirname(os.path.abspath(name)), exist_ok=True)
    try:
        os.mkdir(name, 0o700, dir_fd=at)
    except FileExistsError:
        pass  # made meanwhile by another process: checked by the caller like any other
    # Not followed even for the root (it was just made: a link there is someone's swap);
    # set on the descriptor, not by name, so a swap cannot redirect the chmod.
    fd = os.open(name, flags | _NOFOLLOW, dir_fd=at)
    st = os.fstat(fd)
    if hasattr(os, "getuid") and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)  # a umask may also take the owner's bits away
    return fd


def refusal(exc: OSError, what: str) -> OSError:
    """A symbolic link or a non-folder where a folder or file should be: Untrusted."""
    if exc.errno == errno.ELOOP:
        return Untrusted(f"{what} is a symbolic link")
    if exc.errno == errno.ENOTDIR:
        return Untrusted(f"{what} is a symbolic link or not a directory")
    return exc


def read_private(root: str, parts) -> bytes:
    """The bytes of the file ``root/parts...`` (the last part its name), read only
    where it and every folder down to it pass the check.  Raises Untrusted, or
    OSError where it is missing or not a regular file."""
    *folders, name = parts
    folder = open_folder(root, folders)
    try:
        fd = open_file(folder, name, "its file " + "/".join(parts))
    finally:
        os.close(folder)
    with open(fd, "rb", buffering=0) as f:
        return f.readall()


def open_file(folder: int, name: str, what: str, flags: int = _READ, mode: int = 0o600) -> int:
    """A descriptor of the regular file ``name`` in the checked ``folder``, opened with
    ``flags`` (``O_CREAT`` with ``mode``) and then checked on the descriptor: owned by this
    user, not writable by group or others.  Never follows a symbolic link, and never
    waits on a FIFO (``O_NONBLOCK``: a FIFO at a file's name hung its reader, or writer,
    forever).  Raises Untrusted, or OSError where it is missing or not a regular file."""
    try:
        fd = os.open(name, flags | _NOFOLLOW | _NONBLOCK | getattr(os, "O_CLOEXEC", 0), mode, dir_fd=folder)
    except OSError as exc:  # (a FIFO opened for writing with no reader: ENXIO)
        raise refusal(exc, what) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise OSError(f"{what} is not a regular file")
    reason = foreign(st, what)
    if reason:
        os.close(fd)
        raise Untrusted(reason)
    return fd


def write_private(root: str, parts, data, *, check_root: bool = True, sync: bool = True) -> None:
    """Write ``data`` to ``root/parts...`` (the folders made 0700 where missing, each
    checked), mode 0600.  ``sync``: flushed to disk before the rename (the code cache
    skips it: a torn entry fails its checksum and is computed again)."""
    *folders, name = parts
    folder = open_folder(root, folders, create=True, check_root=check_root)
    try:
        _replace(folder, name, data, 0o600, sync)
    finally:
        os.close(folder)


def write_private_file(path, data, *, levels: int = 1) -> None:
    """Write a private file at ``path``: the ``levels`` folders above it are private
    (made 0700 where missing and checked), the ones above those are the user's choice
    (made with the usual modes).  Raises Untrusted or OSError; nothing is left behind."""
    path = os.path.abspath(os.fspath(path))
    root, parts = path, []
    for _ in range(levels + 1):
        root, part = os.path.split(root)
        parts.insert(0, part)
    if not all(parts):  # "/" reached: no folder of its own to make private
        raise OSError(errno.EINVAL, f"needs {levels} folder(s) of its own above it", path)
    write_private(root, parts, data, check_root=False)


def write_file(path, data) -> None:
    """Write a plain file at ``path`` (a path the user named), atomically; its folder
    must exist.  An existing target must be a regular file: anything else (a FIFO, a
    device, a folder) is an OSError at once, the target untouched."""
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise OSError(errno.EEXIST, "exists and is not a regular file", path)
    mode = 0o666 & ~_umask()
    folder = os.open(parent, _READ | getattr(os, "O_DIRECTORY", 0))
    try:
        _replace(folder, name, data, mode, sync=True)
    finally:
        os.close(folder)


def _replace(folder: int, name: str, data, mode: int, sync: bool) -> None:
    """The temporary file, written and renamed over ``name`` in ``folder``."""
    if isinstance(data, str):
        data = data.encode()
    tmp = f".{name[:64]}.{os.urandom(6).hex()}.tmp"
    fd = os.open(tmp, _CREATE, 0o600, dir_fd=folder)
    try:
        try:
            os.fchmod(fd, mode)  # whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=folder)
        except OSError:
            pass
        raise


def _umask() -> int:
    """The process's umask: read from /proc where it can be (setting it to read it back
    races with other threads creating files), else set and restored."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
