"""Writing the CLI's output files (``rewrite -o``, ``--report-json``) without damaging a path.

* ``-``: standard output.
* A regular file: replaced atomically (a temporary file in the same directory, flushed to disk,
  renamed over it), keeping the old file's permission bits (and, where allowed, its owner).
* A new path: created the same way, with the permissions a new file gets under the umask
  (``0666 & ~umask``), not the temporary file's ``0600``.
* A symlink: followed; its target is replaced (or created, for a dangling link) as above, and
  the link stays a link.
* Anything else that exists (a character device such as a terminal or ``/dev/null``, a FIFO,
  a socket, ``/dev/stdout`` through ``/proc/self/fd``): opened and written through, as
  ``mlir-opt -o`` does; never replaced by a regular file.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path

from .errors import CmatmulError


class OutputError(CmatmulError):
    """An output path cannot be written (one line, naming the path)."""


def write_output(path: str, data: str | bytes) -> None:
    """Write ``data`` to ``path`` as the module docstring says."""
    raw = data.encode() if isinstance(data, str) else data
    if path == "-":
        sys.stdout.buffer.write(raw)
        sys.stdout.flush()
        return
    try:
        _write(path, raw)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write: {exc.strerror or exc}") from None


def _write(path: str, raw: bytes) -> None:
    try:
        st = os.stat(path)  # follows symlinks
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(21, "is a directory")
    if st is not None and not stat.S_ISREG(st.st_mode):  # device, FIFO, socket, /proc/self/fd/N
        with open(path, "wb") as f:
            f.write(raw)
        return
    target = Path(os.path.realpath(path))  # the symlink's target (existing or to be created)
    _replace(target, raw, st)


def _replace(target: Path, raw: bytes, old: os.stat_result | None) -> None:
    """Write ``raw`` to a temporary file beside ``target``, give it ``old``'s mode (the umask's for a
    new file), and rename it over ``target``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, stat.S_IMODE(old.st_mode) if old is not None else 0o666 & ~_umask())
        if old is not None and (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
            try:
                os.chown(tmp, old.st_uid, old.st_gid)
            except PermissionError:  # not ours to give away: the new file is the writer's
                pass
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
