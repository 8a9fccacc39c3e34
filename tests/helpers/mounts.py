"""Real mounts (tmpfs) for the tests of a disk mounted below a watch root and taken off."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import pytest


@dataclass
class Mounts:
    """Mounts a fresh tmpfs (a disk of its own device) on a folder, and takes it off; every
    mount still standing is taken off at the end of its `with` block."""

    standing: list[Path] = field(default_factory=list)

    def mount(self, folder: Path) -> Path:
        """A new tmpfs on `folder`: a disk of its own device."""
        return self._run(folder, "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(folder))

    def bind(self, disk: Path, folder: Path) -> Path:
        """`disk` (a mount) on `folder` as well: the same disk, its device and files, mounted
        again after it was taken off."""
        return self._run(folder, "--bind", str(disk), str(folder))

    def _run(self, folder: Path, *args: str) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot mount here (needs root's CAP_SYS_ADMIN): {done.stderr}")
        self.standing.append(folder)
        return folder

    def unmount(self, folder: Path) -> None:
        subprocess.run(["umount", str(folder)], check=True)
        self.standing.remove(folder)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        for folder in reversed(self.standing):
            subprocess.run(["umount", "-l", str(folder)], check=False)
        self.standing.clear()
