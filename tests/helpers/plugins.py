"""A test plugin that records its calls (`Probe`), for the plugin host's tests in-process and
for the PostgreSQL ones."""

from __future__ import annotations

import time
from collections.abc import Callable

from metanode.plugins import LocalFile, Plugin, RecordLookup, Register

Action = Callable[[LocalFile, RecordLookup, Register], None]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Probe(Plugin):
    """A test plugin: records every call, then does `action`."""

    def __init__(self, action: Action) -> None:
        self.action = action
        self.calls: list[LocalFile] = []
        self.called_at_ms: list[int] = []
        self.arguments: list[str] = []  # repr of everything process() was given

    def process(self, file: LocalFile, record: RecordLookup, register: Register) -> None:
        self.calls.append(file)
        self.called_at_ms.append(now_ms())
        self.arguments.append(repr((file, record, register)))
        self.action(file, record, register)


def probe(
    name: str, action: Action, version: str = "1", weight: int = 1, may_link: bool = False
) -> Probe:
    """A `Probe` under its own class, since name, version, weight and may_link are class-level."""
    cls = type(
        f"Probe_{name}_{version}",
        (Probe,),
        {"name": name, "version": version, "weight": weight, "may_link": may_link},
    )
    instance: Probe = cls(action)
    return instance


def claim(key: str, value: str) -> Action:
    def action(file: LocalFile, record: RecordLookup, register: Register) -> None:
        register(file.cid, key, value)

    return action
