"""Why a write failed, in one line: a full disk, a file size limit, a read-only file system, a file in the path, or
no permission, each naming the path.

Contract:
- `write_problem(exc, target)` looks through `exc` and the exceptions it was raised from or during for the reason a
  write under the folder `target` failed, and returns one line naming it and the path, or None when the failure is
  not about storage (the caller then lets it through as it is):
  - ENOSPC, EDQUOT: "no space left on <target> (<n> free)";
  - EFBIG: "file too large for <target>: the file system's or the process's file size limit (ulimit -f)";
  - EROFS: "<target> is on a read-only file system";
  - ENOTDIR, or EEXIST from creating a folder whose path runs through a file: "<file> is not a directory";
  - EACCES, EPERM: "permission denied writing <target>".
  Libraries that keep only the text are recognised by it (safetensors: "No space left on device (os error 28)").
  A write error that carries neither (torch's zip writer: "unexpected pos 6272 vs 6164", "file write failed")
  counts as a full disk when the target's file system has less than `FULL_BELOW` bytes free.
- `check_writable(target, what)` raises `WriteError` with the same wording ("<what>: <problem>"), before any work,
  when the nearest existing folder on the way to `target` is not a folder, is read-only, or cannot be written; it
  writes nothing.
- `reported_writes(target, what)` is a context manager turning a storage failure inside it into one `WriteError`
  ("<what>: <the line above>"), raised from the original; every other exception, and every `TrainingError`, passes
  unchanged.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lt_plugins.errors import TrainingError

FULL_BELOW = 1 << 20
"""Free bytes under which a write error without an errno is taken for a full disk."""

_SPACE = (errno.ENOSPC, errno.EDQUOT)
_TEXT = {
    errno.ENOSPC: re.compile(r"no space left on device|os error 28\b", re.I),
    errno.EDQUOT: re.compile(r"disk quota exceeded|os error 122\b", re.I),
    errno.EFBIG: re.compile(r"file too large|os error 27\b", re.I),
    errno.EROFS: re.compile(r"read-only file system|os error 30\b", re.I),
}
_WRITE_FAILED = re.compile(r"unexpected pos \d+ vs \d+|file write failed|failed writing", re.I)


class WriteError(TrainingError):
    """A file or folder could not be written (full disk, read-only, a file in the way, no permission)."""


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
    return seen


_KNOWN = (*_SPACE, errno.EFBIG, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EACCES, errno.EPERM)


def _errno(exc: BaseException) -> int | None:
    """The first errno of the chain that this module names (carried by an OSError, else named in a text)."""
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, OSError) and e.errno in _KNOWN:
            return e.errno
    for e in chain:
        for code, pattern in _TEXT.items():
            if pattern.search(str(e)):
                return code
    return None


def _existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (is a file, folder or link)."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int | None:
    """Bytes an unprivileged process may still write on the file system holding `path` (None if unknown)."""
    try:
        st = os.statvfs(_existing(Path(path)))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _size(n: int | None) -> str:
    if n is None:
        return "unknown space"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


def _file_in_the_way(target: Path) -> Path | None:
    """The first component of `target`'s path that exists and is not a folder (a file where a folder must be)."""
    found = _existing(target)
    return found if found != Path(os.path.abspath(target)) and not found.is_dir() else None


def _message(code: int | None, target: Path) -> str | None:
    if code in _SPACE:
        return f"no space left on {target} ({_size(free_bytes(target))} free)"
    if code == errno.EFBIG:
        return f"file too large for {target}: the file system's or the process's file size limit (ulimit -f)"
    if code == errno.EROFS:
        return f"{target} is on a read-only file system"
    if code in (errno.ENOTDIR, errno.EEXIST):
        blocker = _file_in_the_way(target)
        if blocker is None:
            return None
        if blocker.is_symlink():
            return f"{blocker} is a broken symbolic link on the path of {target}"
        return f"{blocker} is not a directory (it is a file on the path of {target})"
    if code in (errno.EACCES, errno.EPERM):
        return f"permission denied writing {target}"
    return None


def write_problem(exc: BaseException, target: str | Path) -> str | None:
    """One line naming why a write under `target` failed, or None when `exc` is not a storage failure."""
    target = Path(target)
    message = _message(_errno(exc), target)
    if message is not None:
        return message
    if any(_WRITE_FAILED.search(str(e)) for e in _chain(exc)):
        free = free_bytes(target)
        if free is not None and free < FULL_BELOW:
            return _message(errno.ENOSPC, target)
    return None


def check_writable(target: str | Path, what: str) -> None:
    """WriteError(f"{what}: {problem}") unless a folder `target` could be created or replaced: its nearest existing
    ancestor (or its parent) is a folder this process may write on a writable file system."""
    target = Path(target)
    if _file_in_the_way(target) is not None:
        raise WriteError(f"{what}: {_message(errno.ENOTDIR, target)}")
    found = _existing(target)
    parent = found if found != Path(os.path.abspath(target)) else found.parent
    try:
        st = os.statvfs(parent)
    except OSError:
        return  # cannot tell: the write itself will say
    if st.f_flag & os.ST_RDONLY:
        raise WriteError(f"{what}: {_message(errno.EROFS, target)}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise WriteError(f"{what}: {_message(errno.EACCES, target)}")


@contextmanager
def reported_writes(target: str | Path, what: str) -> Iterator[None]:
    """Inside: a storage failure under `target` becomes `WriteError(f"{what}: {problem}")` (see the contract)."""
    try:
        yield
    except TrainingError:
        raise
    except Exception as exc:
        problem = write_problem(exc, target)
        if problem is None:
            raise
        raise WriteError(f"{what}: {problem}") from exc
