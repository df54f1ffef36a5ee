"""Files written so that a failure never loses what was there: a new file beside the target, then a rename."""
from __future__ import annotations

import contextlib
import os
import secrets
import stat
from typing import IO, Iterator, Union

PathLike = Union[str, "os.PathLike[str]"]


@contextlib.contextmanager
def atomic_write(path: PathLike, mode: str = "wb") -> Iterator[IO]:
    """A new file in ``path``'s folder, opened in ``mode`` (``"wb"`` or ``"w"``), that replaces ``path`` when the
    block ends.

    On success the file is flushed to disk (``fsync``) and renamed onto ``path`` with ``os.replace`` (atomic on
    POSIX and Windows), so ``path`` holds either its old content or the whole new one, never a part. On any error
    (or an interrupt) the new file is removed and ``path`` is left as it was. As ``open`` would, a symbolic link
    is written through (the file it points to is replaced, the link stays), and a file that exists keeps its
    permissions; a new one gets those of a file created with ``open`` (0666 less the umask).
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"mode must be 'wb' or 'w', got {mode!r}")
    target = os.path.realpath(os.fspath(path))  # through symbolic links, as open() writes
    folder, name = os.path.split(target)
    while True:
        # beside the target, its name cut short enough that the temporary name fits where the target's does
        temporary = os.path.join(folder, f".{name[:100]}.{secrets.token_hex(4)}.tmp")
        try:
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            break
        except FileExistsError:  # another writer's temporary file: draw another name
            continue
    try:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(temporary, stat.S_IMODE(os.stat(target).st_mode))  # an existing file's permissions
        with open(descriptor, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    _sync_folder(folder)


def _sync_folder(folder: str) -> None:
    """Flush the folder's entry of the renamed file to disk, where the system allows it (not on Windows)."""
    with contextlib.suppress(OSError, AttributeError):
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
