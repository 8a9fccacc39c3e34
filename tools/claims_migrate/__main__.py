"""claims-migrate: bring a MetaMesh meta-core Redis keyspace into a metanode data directory.

    python -m tools.claims_migrate --redis redis://127.0.0.1:6379/0 --data-dir ./data [--dry-run]

Run it with the server stopped. Reads both meta-core layouts (v1.x flat keys and the older
one-HASH-per-record), keeps every v1.x rid, groups every CID the way the `cid:` index says, and
re-signs every field as a claim by a freshly generated, low-weight legacy key whose uid it prints
so that it can be blocked later. Idempotent: a second run adds nothing. docs/migration.md has the
rules and the layouts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis

from metanode import config, logs, maintenance
from metanode.clock import now_ms
from metanode.config import Settings
from metanode.errors import MetanodeError
from tools.claims_migrate import keyspace, plan
from tools.claims_migrate.report import Report
from tools.claims_migrate.write import (
    Legacy,
    MigrateError,
    holders,
    legacy_key,
    register,
    write,
)

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
PROGRESS_MIN_KEYS = 10_000  # `--progress auto` shows a bar from this many keys on


@dataclass(frozen=True)
class Options:
    redis_url: str = DEFAULT_REDIS
    key_prefix: str = ""
    data_dir: Path | None = None
    config_file: str | None = None
    dry_run: bool = False
    legacy_weight: int | None = None  # None: 1 on the first run, the registered weight after
    report_path: Path | None = None
    batch: int = 1000
    force: bool = False
    progress: str = "auto"  # auto | always | never


def masked(url: str) -> str:
    """The Redis URL without its password, fit for printing."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class Bar:
    """A rich progress bar on stderr for large keyspaces; silent otherwise."""

    def __init__(self, mode: str, keys: int) -> None:
        self.enabled = mode == "always" or (
            mode == "auto" and keys >= PROGRESS_MIN_KEYS and sys.stderr.isatty()
        )
        self._bar: Any = None
        self._keys = keys
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> Bar:
        if self.enabled:
            self._bar = logs.progress_bar()
            self._bar.start()
            self._tasks["keys"] = self._bar.add_task("reading redis keys", total=self._keys)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def reading(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._tasks["keys"], n)

    def start_writing(self, records: int) -> None:
        if self._bar is not None:
            self._tasks["records"] = self._bar.add_task("writing records", total=records)

    def writing(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._tasks["records"], n)


def connect(url: str) -> redis.Redis:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=120)
        client.ping()
    except (redis.RedisError, ValueError) as exc:
        raise MigrateError(f"cannot reach Redis at {masked(url)}: {exc}") from None
    return client


def _migrate_into(
    settings: Settings,
    planned: Sequence[plan.Planned],
    legacy: Legacy,
    opts: Options,
    ts: int,
    report: Report,
    progress: Callable[[int], None],
) -> None:
    with maintenance.truth_store(settings) as store:
        before = store.max_seq()
        row = register(store, legacy, opts.legacy_weight)
    report.legacy_signer = {
        "uid": legacy.uid,
        "name": row.name,
        "weight": row.weight,
        "may_link": row.may_link,
        "key_file": str(legacy.path) if legacy.path else None,
        "created": legacy.created,
    }
    write(settings, planned, legacy, ts, opts.batch, report, progress)
    with maintenance.truth_store(settings) as store:
        report.changes = store.max_seq() - before


def migrate(opts: Options) -> Report:
    """Run the whole migration (or, with `dry_run`, all of it against a scratch copy of the
    truth) and return its report."""
    started = time.monotonic()
    ts = now_ms()
    settings = config.load(opts.config_file, overrides={"data_dir": opts.data_dir})
    report = Report(
        redis=masked(opts.redis_url),
        data_dir=str(settings.data_dir),
        dry_run=opts.dry_run,
        started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts / 1000)),
    )
    if not opts.dry_run and not opts.force:
        pids = holders(settings)
        if pids:
            raise MigrateError(
                f"{settings.data_dir} is in use by process {', '.join(map(str, pids))} (a "
                "running metanode?). Stop the server first: the migration writes the databases "
                "directly. --force skips this check."
            )
    client = connect(opts.redis_url)
    try:
        total_keys = int(client.dbsize())
        with Bar(opts.progress, total_keys) as bar:
            space = keyspace.read(client, opts.key_prefix, bar.reading)
            report.keyspace = {
                "schema_version": space.schema_version,
                "keys_read": space.keys_read,
                "index_members": space.index_members,
                "cid_index_entries": len(space.index),
                "ignored_keys": dict(sorted(space.ignored.items())),
                "key_prefix": opts.key_prefix,
            }
            planned = plan.plan(space, report)
            bar.start_writing(len(planned))
            if opts.dry_run:
                with tempfile.TemporaryDirectory(prefix="claims-migrate-") as scratch:
                    # a copy of the truth, on PostgreSQL too, never the real one
                    target = maintenance.scratch_truth(settings, Path(scratch) / "data")
                    maintenance.open_store(target)
                    _migrate_into(
                        target,
                        planned,
                        legacy_key(settings, dry_run=True),
                        opts,
                        ts,
                        report,
                        bar.writing,
                    )
            else:
                maintenance.open_store(settings)
                _migrate_into(
                    settings,
                    planned,
                    legacy_key(settings, dry_run=False),
                    opts,
                    ts,
                    report,
                    bar.writing,
                )
                maintenance.catch_up_cache(settings)
    finally:
        client.close()
    report.duration_s = time.monotonic() - started
    return report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="claims-migrate",
        description="Bring a MetaMesh meta-core Redis keyspace into a metanode data directory "
        "(run it with the server stopped). See docs/migration.md.",
    )
    p.add_argument(
        "--redis",
        default=DEFAULT_REDIS,
        metavar="URL",
        help=f"meta-core's Redis (default {DEFAULT_REDIS}).",
    )
    p.add_argument(
        "--key-prefix",
        default="",
        metavar="PREFIX",
        help="Key prefix meta-core was configured with (default none).",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="metanode data directory (default ./data, or METANODE_DATA_DIR).",
    )
    p.add_argument(
        "--config",
        dest="config_file",
        default=None,
        metavar="FILE",
        help="metanode TOML config file (default ./metanode.toml if present).",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="Plan and report everything against a scratch copy; write nothing.",
    )
    p.add_argument(
        "--legacy-weight",
        type=int,
        default=None,
        metavar="N",
        help="Signer weight of the legacy key (default 1 on the first run; later "
        "runs keep the registered weight unless this is given).",
    )
    p.add_argument(
        "--report",
        dest="report_path",
        type=Path,
        default=None,
        metavar="FILE",
        help="Also write the report as JSON to FILE.",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=1000,
        metavar="N",
        help="About N claims per truth transaction (default 1000).",
    )
    p.add_argument(
        "--force", action="store_true", help="Write even if another process has the databases open."
    )
    p.add_argument(
        "--progress",
        choices=("auto", "always", "never"),
        default="auto",
        help=f"Progress bar on stderr (auto: from {PROGRESS_MIN_KEYS} keys, on a terminal).",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.legacy_weight is not None and args.legacy_weight < 0:
        parser().error("--legacy-weight must be 0 or more")
    if args.batch < 1:
        parser().error("--batch must be at least 1")
    opts = Options(
        redis_url=args.redis,
        key_prefix=args.key_prefix,
        data_dir=args.data_dir,
        config_file=args.config_file,
        dry_run=args.dry_run,
        legacy_weight=args.legacy_weight,
        report_path=args.report_path,
        batch=args.batch,
        force=args.force,
        progress=args.progress,
    )
    try:
        report = migrate(opts)
    except (MigrateError, MetanodeError, RuntimeError) as exc:
        print(f"claims-migrate: error: {exc}", file=sys.stderr)
        return 1
    for line in report.lines():
        print(line)
    if report.legacy_signer and not opts.dry_run:
        print(
            f"block it with: metanode signers block {report.legacy_signer['uid']} "
            f"--data-dir {report.data_dir}"
        )
    if opts.report_path is not None:
        report.save(opts.report_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
