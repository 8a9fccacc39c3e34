"""Debian packages the tests need, installed with apt-get when missing (we run as root in CI;
elsewhere the tests that need them skip, saying why)."""

from __future__ import annotations

import os
import shutil
import subprocess


def install(package: str) -> str:
    """`apt-get install` the package (an `apt-get update` first only if the plain install
    fails); the reason it could not be installed, or ''."""
    if shutil.which("apt-get") is None:
        return f"{package} is not installed and there is no apt-get to install it"
    if os.geteuid() != 0:
        return f"{package} is not installed and installing it needs root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-qq", package]
    for steps in ([command], [["apt-get", "update", "-qq"], command]):
        try:
            runs = (subprocess.run(s, env=env, capture_output=True, timeout=900) for s in steps)
            if all(run.returncode == 0 for run in runs):
                return ""
        except (OSError, subprocess.TimeoutExpired):
            continue
    return f"apt-get install {package} failed"
