"""A file rewritten as (size, mtime) cannot see: in place, to the same size, its mtime put back.

What a tag editor told to preserve timestamps, `touch -r`, `rsync --inplace --times` or
`cp -p` over a file of the same size leave: new bytes under the old size and mtime. Only the
inode's ctime, which the kernel moves on every write and no user can set, tells it changed.
"""

from __future__ import annotations

import os
from pathlib import Path


def rewrite_in_place(path: Path, data: bytes) -> None:
    """Write `data` over the start of `path` (same inode), then put its mtime back; `data`
    must leave the size as it was."""
    before = path.stat()
    with path.open("r+b") as out:
        out.write(data)
    after = before
    while after.st_ctime_ns == before.st_ctime_ns:  # a kernel before 6.13 moves it a tick on
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
    ), "the rewrite must keep the size, the mtime and the inode"
