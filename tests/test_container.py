"""The container's build context and entry point, checked without a Docker engine.

No engine runs on the build machines, so the image itself is not built here; what can break
silently is checked instead: every file the Dockerfile copies exists and is not excluded by
.dockerignore, the installed entry point serves, and the HEALTHCHECK command judges /health.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.server import Server

ROOT = Path(__file__).parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text(encoding="utf-8")


def test_every_copied_path_exists_and_is_in_the_context() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    copied = [
        src
        for line in re.findall(r"^COPY (.+)$", DOCKERFILE, flags=re.M)
        for src in line.split()[:-1]
    ]
    assert copied, "the Dockerfile copies nothing"
    for src in copied:
        assert (ROOT / src).exists(), src
        assert src.split("/")[0] not in ignored, f"{src} is excluded by .dockerignore"
    for plugin in (ROOT / "plugins").iterdir():
        assert f"./plugins/{plugin.name}" in DOCKERFILE, f"plugin {plugin.name} is not installed"


def test_image_settings() -> None:
    assert "USER metanode" in DOCKERFILE
    assert 'VOLUME ["/data"]' in DOCKERFILE and "EXPOSE 9000" in DOCKERFILE
    assert "METANODE_WATCH_ROOTS=/files/watch" in DOCKERFILE
    assert "MALLOC_ARENA_MAX=2" in DOCKERFILE  # resident memory of a node run for months
    assert 'CMD ["metanode", "serve", "--host", "0.0.0.0"]' in DOCKERFILE


def healthcheck_command() -> list[str]:
    line = re.search(
        r"CMD (\[.*\])\s*$", DOCKERFILE.split("HEALTHCHECK", 1)[1].split("\nCMD")[0], flags=re.M
    )
    assert line is not None
    return list(json.loads(line.group(1)))


def test_entry_point_serves_and_healthcheck_passes(tmp_path: Path) -> None:
    command = healthcheck_command()
    assert command[:2] == ["sh", "-c"]
    # the installed entry point, on the port the node was given (`METANODE_PORT`, 9000 unset)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    server = Server(tmp_path / "data").start()
    try:
        env["METANODE_PORT"] = str(server.port)
        assert subprocess.run(command, env=env, timeout=60).returncode == 0
    finally:
        server.stop()
    # with the node gone the healthcheck fails, with the one code Docker counts as unhealthy
    done = subprocess.run(command, env=env, timeout=60, capture_output=True)
    assert done.returncode == 1


def test_healthcheck_reads_the_config_file(tmp_path: Path) -> None:
    """A port set only in `METANODE_CONFIG`'s file is the one asked (the old check knew only
    `METANODE_PORT` and asked 9000)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("METANODE_")} | {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    }
    server = Server(tmp_path / "data").start()
    try:
        config = tmp_path / "metanode.toml"
        config.write_text(f"port = {server.port}\n", encoding="utf-8")
        env["METANODE_CONFIG"] = str(config)
        assert subprocess.run(healthcheck_command(), env=env, timeout=60).returncode == 0
    finally:
        server.stop()
