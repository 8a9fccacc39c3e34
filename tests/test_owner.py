"""The box owner's key: made at `init` (mode 0600), registered as signer `owner` above every
plugin's default weight, and signing with strictly increasing timestamps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from metanode import cid as cids
from metanode import keys
from metanode.node import Node
from tests.helpers.server import Server
from tests.helpers.settings import settings_for

pytestmark = pytest.mark.both_backends  # the tests on a `node` run on both

CID_A = cids.midhash_bytes(b"owner a")


def test_init_makes_the_owner_key_and_serve_registers_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    done = subprocess.run(
        [sys.executable, "-m", "metanode", "init", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        check=True,
    )
    key_file = data / "keys" / "owner.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    uid = keys.uid_of_key(keys.load(key_file))
    assert f"owner key: {uid}" in done.stdout
    for weight in ("100", "250"):  # a second start keeps the key and applies a new weight
        env = {} if weight == "100" else {"METANODE_OWNER_WEIGHT": weight}
        srv = Server(data, env=env).start()
        try:
            listed = httpx.get(f"{srv.url}/api/signers", headers=srv.headers).json()["signers"]
        finally:
            srv.stop()
        row = next(s for s in listed if s["name"] == "owner")
        assert (row["uid"], row["weight"], row["may_link"]) == (uid, int(weight), True)
    assert keys.uid_of_key(keys.load(key_file)) == uid


async def test_the_owner_signs_newer_each_time_even_within_one_millisecond(
    tmp_path: Path,
) -> None:
    node = Node(settings_for(tmp_path / "data"), clock=lambda: 1_764_500_000_000)
    await node.start()
    try:
        for title in ("First", "Second", "Third"):
            answer = await node.owner_says([(CID_A, "title", title)])
            assert answer.body["accepted"] == 1, answer.body
        rid = node.group_of(CID_A)
        assert rid is not None
        assert node.record_value(rid, "title") == "Third"
        listed = node.group_claims(rid, "title", node.owner.uid)["claims"]
        assert [c["ts"] for c in listed] == [1_764_500_000_002]
        reverted = await node.owner_says([(CID_A, "title", None)])
        assert reverted.body["accepted"] == 1
        assert node.record_value(rid, "title") is None
    finally:
        await node.stop()
    assert json.loads((tmp_path / "data" / "keys" / "owner.key").read_text())["type"] == "ed25519"
