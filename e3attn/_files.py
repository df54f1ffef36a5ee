"""Files written so that a failure never loses what was there: new files beside the targets, then renames."""
from __future__ import annotations

import contextlib
import os
import secrets
import stat
from typing import IO, Iterator, List, NamedTuple, Tuple, Union

PathLike = Union[str, "os.PathLike[str]"]


@contextlib.contextmanager
def atomic_write(path: PathLike, mode: str = "wb") -> Iterator[IO]:
    """A new file in ``path``'s folder, opened in ``mode`` (``"wb"`` or ``"w"``), that replaces ``path`` when the
    block ends (:func:`atomic_writes` of one file).

    On success the file is flushed to disk (``fsync``) and renamed onto ``path`` with ``os.replace`` (atomic on
    POSIX and Windows), so ``path`` holds either its old content or the whole new one, never a part. On any error
    (or an interrupt) the new file is removed and ``path`` is left as it was. As ``open`` would, a symbolic link
    is written through (the file it points to is replaced, the link stays), and a file that exists keeps its
    permissions; a new one gets those of a file created with ``open`` (0666 less the umask).
    """
    with atomic_writes((path, mode)) as files:
        yield files[0]


@contextlib.contextmanager
def atomic_writes(*targets: Tuple[PathLike, str]) -> Iterator[List[IO]]:
    """New files for ``(path, mode)`` pairs, as :func:`atomic_write`; when the block ends, every one is written and
    flushed to disk before the first is renamed onto its path, so an error while writing any of them (a full
    disk, at the last flush too) replaces none."""
    pending: List[_Pending] = []
    try:
        for path, mode in targets:
            pending.append(_open(path, mode))
        yield [p.file for p in pending]
        for p in pending:
            p.file.flush()
            os.fsync(p.file.fileno())
            p.file.close()
        while pending:
            os.replace(pending[0].temporary, pending[0].target)
            _sync_folder(os.path.dirname(pending.pop(0).target))
    finally:  # an error or an interrupt: the new files not yet renamed are removed
        for p in pending:
            p.file.close()
            with contextlib.suppress(OSError):
                os.remove(p.temporary)


class _Pending(NamedTuple):
    file: IO
    temporary: str
    target: str


def _open(path: PathLike, mode: str) -> _Pending:
    """A new file beside ``path`` (through symbolic links, as ``open`` writes), with the permissions of the file
    it will replace."""
    if mode not in ("wb", "w"):
        raise ValueError(f"mode must be 'wb' or 'w', got {mode!r}")
    target = os.path.realpath(os.fspath(path))
    folder, name = os.path.split(target)
    # its name cut to 150 bytes, so that the temporary name fits wherever the target's does (255 bytes)
    short = name.encode("utf-8", "surrogateescape")[:150].decode("utf-8", "ignore")
    while True:
        temporary = os.path.join(folder, f".{short}.{secrets.token_hex(4)}.tmp")
        try:
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            break
        except FileExistsError:  # another writer's temporary file: draw another name
            continue
    try:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(temporary, stat.S_IMODE(os.stat(target).st_mode))  # an existing file's permissions
        file = open(descriptor, mode, **({} if "b" in mode else {"encoding": "utf-8"}))
    except BaseException:
        os.close(descriptor)
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    return _Pending(file, temporary, target)


def _sync_folder(folder: str) -> None:
    """Flush the folder's entry of the renamed file to disk, where the system allows it (not on Windows)."""
    with contextlib.suppress(OSError, AttributeError):
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
