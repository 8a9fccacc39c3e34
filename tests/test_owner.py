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
from tests.helpers.server import Server, free_port
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
    listed = subprocess.run(  # registered from `init` on, not from the first start
        [sys.executable, "-m", "metanode", "signers", "list", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        check=True,
    )
    [row] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (row["uid"], row["name"], row["weight"], row["may_link"]) == (uid, "owner", 100, True)
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


def test_a_truth_of_another_owner_key_is_refused_until_adopted(tmp_path: Path) -> None:
    """A truth restored without its keys, or a replica given a fresh data directory on the
    live database: the node registered a second signer `owner` (weight 100, may link) whose
    edits competed with the first's. Refused at `init` and `serve`, until `--new-owner`."""
    data = tmp_path / "data"
    first = metanode("init", "--data-dir", str(data))
    assert first.returncode == 0, first.stderr
    old = keys.uid_of_key(keys.load(data / "keys" / "owner.key"))
    (data / "keys" / "owner.key").unlink()  # the keys lost
    for command in (("init",), ("serve", "--port", str(free_port()))):
        refused = metanode(*command, "--data-dir", str(data))
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.startswith(
            f"error: owner_mismatch: this node's databases belong to the owner key {old}"
        ), refused.stderr
    adopted = metanode("init", "--new-owner", "--data-dir", str(data))
    assert adopted.returncode == 0, adopted.stderr
    new = keys.uid_of_key(keys.load(data / "keys" / "owner.key"))
    assert new != old and f"owner key: {new}" in adopted.stdout
    assert adopted.stderr.startswith(  # a key that may be stolen kept weight 100, unsaid
        f"warning: the former owner key {old} keeps its weight, and its edits stand; if it may "
        f"be in other hands, `metanode signers block {old}`"
    )
    srv = Server(data).start()
    try:
        listed = httpx.get(f"{srv.url}/api/signers", headers=srv.headers).json()["signers"]
    finally:
        srv.stop()
    assert [s["uid"] for s in listed if s["name"] == "owner"] == [new]
    [former] = [s for s in listed if s["uid"] == old]  # kept, as the warning says, by a name
    assert (former["name"], former["weight"], former["status"]) == ("former owner", 100, "active")


def metanode(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "metanode", *args], capture_output=True, text=True, timeout=120
    )


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
