"""Writing files so that a reader never sees half of one, and turning OS errors into one line."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

_REMEDIES = {
    errno.EROFS: "it is on a read-only filesystem: build in a writable checkout",
    errno.EACCES: "make it writable for this user",
    errno.EPERM: "make it writable for this user",
    errno.ENOSPC: "free some disk space",
    errno.EDQUOT: "free some disk space",
    errno.ENOENT: "check that it exists",
    errno.ENOTDIR: "a part of the path is a file, not a folder: move that file away",
    errno.EISDIR: "it is a folder: move it away",
}


def describe_os_error(exc: OSError) -> str:
    """``path: reason: remedy`` for an OSError the tool did not expect."""
    reason = exc.strerror or str(exc)
    where = exc.filename if exc.filename is not None else "a file"
    if exc.filename2 is not None:
        where = f"{where} -> {exc.filename2}"
    remedy = _REMEDIES.get(exc.errno or 0, "check the path and try again")
    return f"{where}: {reason}: {remedy}"


def write_atomically(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` in one rename inside its own folder."""
    handle, partial_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    partial = Path(partial_name)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        partial.chmod(mode)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def place(source: Path, destination: Path, mode: int = 0o644) -> None:
    """Copy ``source`` to ``destination`` and rename it into place inside the destination's own
    folder, so it works when the two are on different filesystems and never leaves half a file."""
    handle, partial_name = tempfile.mkstemp(
        dir=destination.parent, prefix=f".{destination.name}.", suffix=".partial"
    )
    os.close(handle)
    partial = Path(partial_name)
    try:
        shutil.copyfile(source, partial)
        partial.chmod(mode)
        os.replace(partial, destination)
    finally:
        partial.unlink(missing_ok=True)
