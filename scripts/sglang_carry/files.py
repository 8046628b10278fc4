"""Writing files so that a reader never sees half of one, and turning OS errors into one line."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def naming(path: Path) -> Iterator[None]:
    """An OSError raised inside that names no file (a write's "No space left on device") names
    ``path``, so its one error line says where."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise


def write_atomically(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` in one rename inside its own folder."""
    with naming(path):
        handle, partial_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
        partial = Path(partial_name)
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(data)
            partial.chmod(mode)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)


# A folder being replaced by replace_folder: the new one while it is written, the old one while
# the two are swapped.
INCOMING_SUFFIX = ".incoming"
OUTGOING_SUFFIX = ".outgoing"


def _sibling(folder: Path, suffix: str) -> Path:
    return folder.with_name(f".{folder.name}{suffix}")


def replaced_by(sibling: Path) -> Path:
    """The folder an ``.incoming``/``.outgoing`` sibling of replace_folder belongs to."""
    return sibling.with_name(sibling.name[1:].removesuffix(INCOMING_SUFFIX).removesuffix(OUTGOING_SUFFIX))


def recover_folder(folder: Path) -> None:
    """Undo what a replace_folder killed part-way left: a half-written new folder goes; an old
    one set aside but not yet replaced comes back. Only for a caller that holds the checkout's
    lock, so that no live replace_folder is at work."""
    incoming, outgoing = _sibling(folder, INCOMING_SUFFIX), _sibling(folder, OUTGOING_SUFFIX)
    if outgoing.is_dir():
        if folder.is_dir():
            shutil.rmtree(outgoing)
        else:
            os.rename(outgoing, folder)
    if incoming.is_dir():
        shutil.rmtree(incoming)


def replace_folder(folder: Path, files: dict[str, bytes], mode: int = 0o644) -> None:
    """Make ``folder`` hold exactly ``files``, as one unit: they are written into a new folder
    beside it, which then takes its place. A fault while writing leaves ``folder`` as it was."""
    recover_folder(folder)
    incoming, outgoing = _sibling(folder, INCOMING_SUFFIX), _sibling(folder, OUTGOING_SUFFIX)
    try:
        with naming(incoming):
            incoming.mkdir(parents=True)
        for name, data in files.items():
            (incoming / name).parent.mkdir(parents=True, exist_ok=True)  # a name may hold folders
            with naming(folder / name), (incoming / name).open("wb") as out:
                out.write(data)
            (incoming / name).chmod(mode)
    except BaseException:
        shutil.rmtree(incoming, ignore_errors=True)
        raise
    with naming(folder):
        set_aside = False
        try:
            if folder.exists():
                os.rename(folder, outgoing)
                set_aside = True
            os.rename(incoming, folder)
        except BaseException:
            # A swap that fails (a busy mount point, a folder made read-only) puts the old folder
            # back itself: only a command killed in between leaves the two for the next to sort.
            if set_aside and not folder.exists():
                os.rename(outgoing, folder)
            shutil.rmtree(incoming, ignore_errors=True)
            raise
        shutil.rmtree(outgoing, ignore_errors=True)


def place(source: Path, destination: Path, mode: int = 0o644) -> None:
    """Copy ``source`` to ``destination`` and rename it into place inside the destination's own
    folder, so it works when the two are on different filesystems and never leaves half a file."""
    handle, partial_name = tempfile.mkstemp(
        dir=destination.parent, prefix=f".{destination.name}.", suffix=".partial"
    )
    os.close(handle)
    partial = Path(partial_name)
    try:
        with naming(destination):
            shutil.copyfile(source, partial)
        partial.chmod(mode)
        os.replace(partial, destination)
    finally:
        partial.unlink(missing_ok=True)
