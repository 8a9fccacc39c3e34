"""/metrics of a real `metanode serve` as an operator graphs it: latency buckets that tell a read
from a write, no series a client can make at will, and every family documented
(docs/operations.md, "Metrics")."""

from __future__ import annotations

import re
import secrets
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from metanode import cid as cids
from metanode import workers
from tests.helpers.claims import Signer
from tests.helpers.server import Server

DOCS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
META = "/api/meta/{cid}"


def scrape(server: Server) -> str:
    response = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.text


def buckets(text: str, family: str, **labels: str) -> dict[float, float]:
    """The cumulative bucket counts of one histogram series, by upper bound."""
    return {
        float(sample.labels["le"]): sample.value
        for found in text_string_to_metric_families(text)
        if found.name == family
        for sample in found.samples
        if sample.name == f"{family}_bucket"
        and {k: v for k, v in sample.labels.items() if k != "le"} == labels
    }


def test_reads_and_writes_land_in_buckets_that_tell_them_apart(server: Server) -> None:
    """A record's read takes a fraction of a millisecond: with prometheus-client's default
    buckets (5 ms the first) every read was in the first one, and no quantile said anything."""
    signer = Signer()
    server.register(signer.uid, "t")
    cid = cids.midhash_bytes(b"buckets")
    claim = signer.claim(cid, "title", "a")
    posted = httpx.post(
        f"{server.url}/api/claims", headers=server.headers, json={"claims": [claim]}, timeout=60
    )
    assert posted.status_code == 200, posted.text
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(20):
            assert client.get(f"/api/meta/{cid}").status_code == 200
    text = scrape(server)
    reads = buckets(text, "metanode_request_seconds", route=META, method="GET", status="200")
    assert min(reads) == 0.0005, sorted(reads)
    assert reads[float("inf")] == 20
    # (where the reads fall is a matter of time: a loaded machine may put all 20 past 2.5 ms)
    ingest = buckets(text, "metanode_ingest_seconds")
    assert sorted(ingest) == sorted(reads), "both histograms have the same bounds"


def test_every_refused_batch_is_counted_by_its_slug(server: Server) -> None:
    """A tampered claim under its slug, a body that is not JSON and one over
    `max_batch_bytes` under theirs: a client that sends nothing but garbage is seen in
    `metanode_claims_rejected_total` (it went uncounted but for a tampered claim)."""
    signer = Signer()
    server.register(signer.uid, "t")
    tampered = {**signer.claim(cids.midhash_bytes(b"refused"), "title", "a"), "value": "b"}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as client:
        assert client.post("/api/claims", json={"claims": [tampered]}).status_code == 400
        for body in (b"{not json", b" " * 4_300_000):  # max_batch_bytes: 4 MiB
            refused = client.post(
                "/api/claims", content=body, headers={"content-type": "application/json"}
            )
            assert refused.status_code in (400, 413), refused.text
    rejected = {
        sample.labels["slug"]: sample.value
        for family in text_string_to_metric_families(scrape(server))
        for sample in family.samples
        if sample.name == "metanode_claims_rejected_total"
    }
    assert rejected == {"bad_signature": 1, "invalid_json": 1, "too_large": 1}, rejected


def test_random_paths_and_cids_make_no_new_series(server: Server) -> None:
    """A hostile client's random addresses are counted under their route template (or
    `unmatched`), never under their path: the scrape does not grow with them."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        client.get("/no-such-page")
        client.get("/api/meta/not-a-cid")
        scrape(server)  # the scrape's own series
        before = series(scrape(server))
        for _ in range(500):
            client.get(f"/{secrets.token_hex(8)}/{secrets.token_hex(8)}")
            client.get(f"/api/meta/{secrets.token_hex(16)}")
    text = scrape(server)
    assert series(text) == before
    assert "/no-such-page" not in text and "not-a-cid" not in text
    unmatched = {
        sample.labels["status"]
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("route") == "unmatched" and sample.name.endswith("_count")
    }
    assert unmatched == {"401"}, unmatched  # an unknown path asks for the token


def series(text: str) -> set[str]:
    """The series of a scrape: each sample's name and labels."""
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if not line.startswith("#")}


def documented() -> dict[str, str]:
    """Every metric docs/operations.md's "Metrics" table names, with the type it gives."""
    section = DOCS.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    found: dict[str, str] = {}
    for row in section.splitlines():
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if row.startswith("| `metanode_") and len(cells) >= 3:
            for name in re.findall(r"`(metanode_\w+)", cells[0]):
                found[name] = cells[1]
    return found


def test_every_family_a_scrape_shows_is_documented_with_its_type(
    server: Server, tmp_path: Path
) -> None:
    """What one process scrapes, and the supervisor's restart families of `--workers N`
    (collected from its own status file), each in the table with its type; nothing in the
    table that is not scraped."""
    families = list(text_string_to_metric_families(scrape(server)))
    families += list(workers.Restarts(tmp_path / "workers.json").collect())
    scraped = {
        family.name + ("_total" if family.type == "counter" else ""): family.type
        for family in families
    }
    assert scraped == documented()
