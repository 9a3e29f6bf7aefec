"""Files only this user may read: a server's KV states and its results (documents' answers
and their token ids) are the user's data, and any other local user could read a file
written with the default umask, or plant a link where one is about to be written."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import IO


def private_folder(folder: Path) -> None:
    """Make `folder` (and its missing parents) readable by this user alone; refuse one that
    another user owns, who could read or replace what is in it."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.stat().st_uid != os.getuid():
        raise PermissionError(errno.EACCES, "owned by another user", str(folder))
    folder.chmod(0o700)


def open_private(path: Path, append: bool = False) -> IO[bytes]:
    """`path` for writing, readable by this user alone, never through a symbolic link."""
    mode = os.O_APPEND if append else os.O_TRUNC
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | mode, 0o600)
    return os.fdopen(fd, "ab" if append else "wb")


def set_aside(path: Path) -> None:
    """Rename an earlier file `path` to `path.N`, N the first number free, so that a new
    one can take its name and nothing earlier is lost."""
    if not path.exists() and not path.is_symlink():
        return
    n = 1
    while (aside := path.with_name(f"{path.name}.{n}")).exists() or aside.is_symlink():
        n += 1
    path.rename(aside)
