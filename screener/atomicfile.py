"""The one way screener writes a file: whole or not at all, and on disk before it is named.

A reader (the daemon taking in an alarm, a screen reading its golden, the next start reading the
kernel log's position) must never see half a file, and a file a writer reported written must
survive a power cut of the node. So every file is written to a temporary name in its own folder,
flushed and fsync'ed, renamed over its final name (atomic on POSIX), and the folder is fsync'ed
so that the rename itself is durable. Writers differ only in who may read the result: `public`
gives the permissions an ordinary file gets (0666 less the umask), otherwise the file keeps the
temporary file's 0600.

Imports only the standard library.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic", "fsync_dir"]


def write_atomic(final: str | os.PathLike[str], data: bytes | str, *,
                 public: bool = False) -> Path:
    """Write `data` (str: UTF-8) to `final` so readers see all of it or nothing and a reported
    write is durable; returns the path. The folder must exist. Raises OSError (nothing is left
    under a temporary name)."""
    path = Path(final)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if public:
                umask = os.umask(0)
                os.umask(umask)
                os.fchmod(f.fileno(), 0o666 & ~umask)
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)
    return path


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Make a rename in `folder` durable (best effort: not every filesystem lets a directory be
    opened or fsync'ed)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
