"""The command line as a client of a running node: where it looks, what it says when nothing or
something else answers, and click's own errors in the one `error: <slug>: <message>` form."""

from __future__ import annotations

import http.server
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import httpx
import pytest

from metanode import cid as cids
from metanode import client, errors
from tests.helpers.claims import NOW_MS, Signer
from tests.helpers.server import Server, free_port
from tests.helpers.wait import poll

MIDHASH = cids.midhash_bytes(b"the command line as a client")


def metanode(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    """Run the real `metanode` command with a hermetic environment (no METANODE_* but `env`)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("METANODE_")}
    return subprocess.run(
        [sys.executable, "-m", "metanode", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**base, **(env or {})},
    )


def test_client_commands_find_a_node_on_another_port_from_the_settings(
    server: Server, tmp_path: Path
) -> None:
    """METANODE_PORT alone points `get`, `claim post` and `events` at the node; the token comes
    from the local data directory (METANODE_DATA_DIR), and never has to be exported."""
    assert server.port != 9000
    env = {"METANODE_PORT": str(server.port), "METANODE_DATA_DIR": str(server.data_dir)}
    assert metanode("get", MIDHASH, env=env).stderr.startswith("error: unknown_cid: ")

    alice = Signer()
    server.register(alice.uid, "alice")
    claim = alice.claim(MIDHASH, "title", "Found")
    posted = metanode("claim", "post", env=env, stdin=json.dumps(claim))
    assert posted.returncode == 0, posted.stderr
    assert json.loads(posted.stdout)["accepted"] == 1
    found = metanode("get", MIDHASH, env=env)
    assert found.returncode == 0 and json.loads(found.stdout)["metadata"]["title"] == "Found"

    # the same through a TOML file naming the port, from the directory it sits in
    (tmp_path / "metanode.toml").write_text(
        f'port = {server.port}\ndata_dir = "{server.data_dir}"\n'
    )
    assert metanode("get", MIDHASH, cwd=tmp_path).returncode == 0

    with subprocess.Popen(
        [sys.executable, "-m", "metanode", "events", "--snapshot"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("METANODE_")}, **env},
    ) as follow:
        try:
            out = Lines(follow.stdout)
            lines = [out.next(30.0) for _ in range(3)]
            sets = [line for line in lines if line.split(" ")[1:2] == ["set"]]
            assert any('"Found"' in line for line in sets), lines
        finally:
            follow.kill()


def test_a_refusal_of_the_node_is_an_error_line_not_an_answer(server: Server) -> None:
    """What the node refuses comes out as every error of the command line does (stderr, the
    slug, exit 2), a rejected batch with one line per claim: never the error envelope on stdout,
    where a script reads the answer."""
    env = {"METANODE_PORT": str(server.port), "METANODE_DATA_DIR": str(server.data_dir)}
    asked = {MIDHASH: "unknown_cid", "not-a-cid": "invalid_cid", "../../health": "not_found"}
    for cid, slug in asked.items():  # the last one a CID's path, never the /health route
        refused = metanode("get", cid, env=env)
        assert (refused.returncode, refused.stdout) == (2, "")
        assert refused.stderr.startswith(f"error: {slug}: ") and refused.stderr.count("\n") == 1
    alice = Signer()
    server.register(alice.uid, "alice of the refusals")
    good = alice.claim(MIDHASH, "title", "Found")
    bad = {**good, "value": "X"}
    refused = metanode("claim", "post", env=env, stdin=json.dumps([good, bad]))
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr.splitlines() == [
        "error: invalid_batch: 1 claim(s) rejected; nothing was written",
        "  claim 2: bad_signature: signature does not verify against uid",
    ]  # named as read: the array's second element (or a JSON line's number)
    refused = metanode("claim", "post", json.dumps(bad), json.dumps(good), env=env)
    assert refused.stderr.splitlines()[1:] == [
        "  argument 1: bad_signature: signature does not verify against uid"
    ]
    assert httpx.get(f"{server.url}/api/meta/{MIDHASH}", timeout=10).status_code == 404


def test_a_refused_token_says_where_the_command_looked_for_it(
    server: Server, tmp_path: Path
) -> None:
    """The node's 401 speaks of the header and the web page's cookie: a command run away from
    the node's data directory (no api-token there), or given another box's token, says where
    it looked and what to give."""
    env = {"METANODE_PORT": str(server.port)}
    away = tmp_path / "elsewhere"  # not the node's directory: its data/ holds no api-token
    away.mkdir()
    kept = away / "data" / "api-token"
    for refused, hint in (
        (
            metanode("events", env=env, cwd=away),
            "  no token was sent: none was given (--token or METANODE_TOKEN) and there is none "
            f"in {kept}; give --token, or --data-dir naming the node's data directory (or run "
            "where it is)",
        ),
        (
            metanode("claim", "post", "{}", env={**env, "METANODE_TOKEN": "another box's"}),
            "  the token from --token or METANODE_TOKEN was refused: give this node's, the "
            "content of its data directory's api-token",
        ),
        (
            metanode("peers", "list", env={**env, "METANODE_DATA_DIR": str(server.data_dir)}),
            None,  # the data directory's token: taken
        ),
    ):
        if hint is None:
            assert refused.returncode == 0, refused.stderr
            continue
        assert (refused.returncode, refused.stdout) == (2, ""), refused.stderr
        lines = refused.stderr.splitlines()
        assert lines[0].startswith("error: unauthorized: ") and lines[1:] == [hint], lines


def test_an_address_with_a_path_the_node_does_not_serve_is_named_beside_the_refusal(
    server: Server,
) -> None:
    """The node asks a token of every path it does not serve: `health --url …/ui`, the address
    copied from the browser, was a bare `unauthorized` for a command that needs no token."""
    for args in (("health",), ("get", MIDHASH)):
        refused = metanode(*args, "--url", f"{server.url}/ui")
        assert (refused.returncode, refused.stdout) == (2, ""), refused.stderr
        lines = refused.stderr.splitlines()
        assert lines[0].startswith("error: unauthorized: ") and lines[1:] == [
            f"  the address {server.url}/ui has a path, /ui: unless it is the node's root_path, "
            "give the node's base address (http://host:port), under which every route is"
        ], lines
    assert metanode("health", "--url", f"{server.url}/").returncode == 0


def test_get_waits_for_a_file_just_dropped_when_asked_to(server: Server) -> None:
    """The README's tour asked for a file's record right after writing it, before the watcher
    had settled and hashed it: `unknown_cid`, as if it were broken. `--wait` keeps asking."""
    env = {"METANODE_PORT": str(server.port)}
    content = os.urandom(5000)
    midhash = cids.midhash_bytes(content)
    server.media.mkdir(exist_ok=True)
    (server.media / "just.dropped.mkv").write_bytes(content)
    found = metanode("get", midhash, "--wait", "120", env=env)
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["filePath"] == str(server.media / "just.dropped.mkv")
    bad = metanode("get", "not-a-cid", "--wait", "120", env=env)  # no waiting for the hopeless
    assert bad.returncode == 2 and bad.stderr.startswith("error: invalid_cid: ")


@pytest.mark.parametrize("found_by", ["port", "data_dir"])
def test_get_waits_for_a_node_still_starting(tmp_path: Path, found_by: str) -> None:
    """Right after `make serve` the node may not answer yet: `--wait` asks again, at the port
    of its settings, or where the node, started on another, records its address in the data
    directory once it took it."""
    srv = Server(tmp_path / "data")
    content = os.urandom(5000)
    srv.media.mkdir(parents=True, exist_ok=True)
    (srv.media / "early.mkv").write_bytes(content)
    env = {k: v for k, v in os.environ.items() if not k.startswith("METANODE_")}
    if found_by == "port":
        env["METANODE_PORT"] = str(srv.port)
    else:  # the settings name a port nothing answers at
        env |= {"METANODE_PORT": str(free_port()), "METANODE_DATA_DIR": str(srv.data_dir)}
    asking = subprocess.Popen(
        [sys.executable, "-m", "metanode", "get", cids.midhash_bytes(content), "--wait", "300"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        srv.start()
        out, err = asking.communicate(timeout=300)
    finally:
        asking.kill()
        srv.stop()
    assert asking.returncode == 0, err
    assert json.loads(out)["filePath"] == str(srv.media / "early.mkv")


def test_ctrl_c_is_exit_130_and_one_line_not_a_traceback() -> None:
    """Ctrl-C ended a command with `error: aborted` and exit 1, which a script reads as a
    verdict (a claim that did not verify, a degraded node): now 130, as a shell says it. A
    `get --wait` on an address nothing answers says it waits (it waited in silence), then is
    interrupted in the middle of its wait."""
    nowhere = f"http://127.0.0.1:{free_port()}"
    asking = subprocess.Popen(
        [sys.executable, "-m", "metanode", "get", MIDHASH, "--wait", "600", "--url", nowhere],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert asking.stderr is not None
        first = asking.stderr.readline()
        assert first.startswith("waiting up to 600 s: no node answers at http://127.0.0.1:"), first
        asking.send_signal(signal.SIGINT)
        out, err = asking.communicate(timeout=120)
    finally:
        asking.kill()
    assert asking.returncode == 130, err
    assert out == "" and err.strip() == "error: interrupted", err


# Run in a real interpreter: Ctrl-C (a real SIGINT, sent to itself) lands in the middle of the
# command line's imports, as it does when pressed within a second of the start on a small box
SIGINT_WHILE_IMPORTING = """
import os, runpy, signal, sys

class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "metanode.node":  # imported by metanode.cli, after metanode.__main__ runs
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Interrupt())
sys.argv = ["metanode", "--version"]
runpy.run_module("metanode", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_while_the_command_line_is_imported_is_the_same_one_line() -> None:
    """A Ctrl-C before the command had started (its imports: 0.7 s on a busy box) printed the
    traceback of whichever module was being imported."""
    done = subprocess.run(
        [sys.executable, "-c", SIGINT_WHILE_IMPORTING],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 130, done.stderr
    assert done.stdout == "" and done.stderr.strip() == "error: interrupted", done.stderr


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (("--since", "yesterday"), "error: invalid_cursor: cursor 'yesterday' is not <epoch>-"),
        (("--rid", "film"), "error: invalid_rid: not a rid: 'film'"),
    ],
)
def test_events_refuses_a_mistyped_option_before_it_waits_for_the_node(
    option: tuple[str, str], said: str
) -> None:
    """With no node up, `events --since yesterday` said it waited for the node, to be refused
    by it once it came: the node's own rules are applied where the option was typed."""
    refused = metanode("events", "--url", f"http://127.0.0.1:{free_port()}", *option)
    assert (refused.returncode, refused.stdout) == (2, ""), refused.stderr
    assert refused.stderr.startswith(said) and "waiting" not in refused.stderr, refused.stderr


def test_plugins_list_and_retry_ask_the_running_node(server: Server) -> None:
    """`metanode plugins list` and `retry` are the running node's GET /api/plugins and POST
    /api/plugins/{name}/retry (this server runs no plugins: the list is empty, a retry refused
    with the reason)."""
    env = {"METANODE_PORT": str(server.port), "METANODE_DATA_DIR": str(server.data_dir)}
    listed = metanode("plugins", "list", env=env)
    assert (listed.returncode, listed.stdout, listed.stderr) == (0, "", "")
    refused = metanode("plugins", "retry", "fileinfo", env=env)
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr == (
        "error: not_found: no plugin runs in this process (plugins_enabled is off)\n"
    )


def test_an_address_that_is_no_url_is_bad_input_not_a_missing_node() -> None:
    for args in (("get", MIDHASH), ("events",), ("claim", "post", "--token", "t", "{}")):
        done = metanode(*args, "--url", "notaurl")
        assert (done.returncode, done.stdout) == (2, ""), done
        assert done.stderr == (
            "error: invalid_request: 'notaurl' is not a node's address (http://host:port): "
            "it is not http:// or https://\n"
        )
    for url, why in (
        ("http://127.0.0.1:94011", "its port is not 1 to 65535"),
        ("http://user:pw@127.0.0.1:9000", "it carries a user or password"),
        ("http://127.0.0.1:9000/?x=1", "it has a query or fragment"),
    ):
        done = metanode("get", MIDHASH, "--url", url)
        assert done.returncode == 2 and why in done.stderr, done


def test_serve_on_a_port_another_server_holds_says_so_and_never_that_it_serves(
    tmp_path: Path,
) -> None:
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    try:
        for workers in ("1", "2"):
            done = metanode(
                "serve",
                "--port",
                str(port),
                "--workers",
                workers,
                env={"METANODE_DATA_DIR": str(tmp_path / "data"), "METANODE_WATCH_ENABLED": "0"},
            )
            assert done.returncode == 2, done
            assert "serving" not in done.stdout
            assert done.stderr.splitlines()[-1] == (
                f"error: cannot_listen: 127.0.0.1:{port}: Address already in use"
            )
            assert not (tmp_path / "data").exists()  # no databases, keys or token made for it
    finally:
        holder.close()


def test_a_host_serve_cannot_have_is_said_in_words(tmp_path: Path) -> None:
    """A host that does not resolve was `cannot_listen: …: Unknown error -2` (the resolver's
    code read as an errno)."""
    env = {"METANODE_DATA_DIR": str(tmp_path / "data"), "METANODE_WATCH_ENABLED": "0"}
    done = metanode("serve", "--host", "no-such-host.invalid", "--port", "9", env=env)
    assert done.returncode == 2, done
    last = done.stderr.splitlines()[-1]
    assert last.startswith("error: cannot_listen: no-such-host.invalid:9: "), last
    assert "Unknown error" not in last and "host must be an address of this machine" in last


def test_a_refused_connection_is_one_line(tmp_path: Path) -> None:
    port = free_port()
    for args in (("get", MIDHASH), ("claim", "post", "--token", "t", "{}")):
        done = metanode(*args, env={"METANODE_PORT": str(port)})
        assert done.returncode == 2, done
        lines = done.stderr.splitlines()
        assert len(lines) == 1, done.stderr
        assert lines[0].startswith(
            f"error: unreachable: no node answers at http://127.0.0.1:{port}: "
        ), lines[0]
        assert "refused" in lines[0].lower()
        assert lines[0].endswith(  # whence the address, and where to find the node instead
            ": Connection refused (from the settings' host and port: no running node recorded "
            f"its address in {Path.cwd() / 'data'}); a node on this machine is found by its "
            "data directory (--data-dir, METANODE_DATA_DIR), any other named with --url"
        )


@pytest.mark.parametrize("found_by", ["port", "data_dir"])
def test_events_says_it_waits_then_follows_the_node_once_it_is_up(
    tmp_path: Path, found_by: str
) -> None:
    """`events` against a node that is not up yet says it is waiting, once, and then follows it
    as soon as it answers: at the port of its settings, or, started on another, where it
    records its address in the data directory (asked again at each retry)."""
    srv = Server(tmp_path / "data")
    settings_port = srv.port if found_by == "port" else free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("METANODE_")},
        "METANODE_PORT": str(settings_port),
        "METANODE_DATA_DIR": str(srv.data_dir),
    }
    subprocess.run(
        [sys.executable, "-m", "metanode", "init", "--data-dir", str(srv.data_dir)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    with subprocess.Popen(
        [sys.executable, "-m", "metanode", "events"],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as follow:
        _follow_until_up(follow, srv, settings_port)


def _follow_until_up(follow: subprocess.Popen[str], srv: Server, settings_port: int) -> None:
    try:
        out, err = Lines(follow.stdout), Lines(follow.stderr)
        said = err.next(60.0)
        assert said.startswith(
            f"waiting for the node at http://127.0.0.1:{settings_port} (from the settings' "
            f"host and port: no running node recorded its address in {srv.data_dir}; "
        ), said
        srv.start()
        alice = Signer()
        httpx.post(
            f"{srv.url}/api/signers",
            headers=srv.headers,
            timeout=10,
            json={"uid": alice.uid, "name": "alice"},
        ).raise_for_status()
        deadline = time.monotonic() + 60
        line = ""
        attempt = 0
        while "Arrived" not in line and time.monotonic() < deadline:
            # a new value until the follower, which retries every second, is connected and sees
            # one (live only: what changed before it connected is not sent)
            attempt += 1
            httpx.post(
                f"{srv.url}/api/claims",
                headers=srv.headers,
                timeout=10,
                json={
                    "claims": [
                        alice.claim(MIDHASH, "title", f"Arrived {attempt}", ts=NOW_MS + attempt)
                    ]
                },
            ).raise_for_status()
            line = out.next(2.0)
        assert "Arrived" in line, line
    finally:
        follow.kill()
        if srv.proc is not None:
            srv.stop()
            srv.print_log()


class Lines:
    """A child's output read line by line on one thread, so a test waits for a line with a
    deadline and never hangs on a silent child."""

    def __init__(self, stream: IO[str] | None) -> None:
        assert stream is not None
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(
            target=lambda: [self._lines.put(line) for line in stream], daemon=True
        ).start()

    def next(self, seconds: float) -> str:
        """The next line, or "" if none came within `seconds`."""
        try:
            return self._lines.get(timeout=seconds)
        except queue.Empty:
            return ""


class _NotANode(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<html>a router's login page</html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_an_answer_that_is_not_a_metanode_is_a_clear_error() -> None:
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotANode)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        port = str(other.server_address[1])
        for args in (("get", MIDHASH), ("events", "--token", "t")):
            done = metanode(*args, env={"METANODE_PORT": port})
            assert done.returncode == 2, done
            assert done.stderr.startswith(
                f"error: not_metanode: http://127.0.0.1:{port} answered 200 with text/html"
            ), done.stderr
    finally:
        other.shutdown()
        other.server_close()


def test_click_usage_errors_use_the_one_error_form(tmp_path: Path) -> None:
    for args, fragment in (
        (("cid", "midhash"), "Missing argument"),
        (("get", MIDHASH, "--bogus"), "No such option"),
        (("serve", "--port", "99999"), "99999"),
        (
            (
                "claim",
                "sign",
                "--key",
                str(tmp_path / "absent.key"),
                "--cid",
                MIDHASH,
                "--key-name",
                "title",
                "--value",
                "v",
            ),
            "absent.key",
        ),
    ):
        done = metanode(*args)
        assert done.returncode == 2, (args, done)
        first = done.stderr.splitlines()[0]
        assert first.startswith("error: usage: "), (args, done.stderr)
        assert fragment in first, (args, first)
        assert "Usage:" not in done.stderr and "Traceback" not in done.stderr


def test_a_port_out_of_range_is_refused_from_any_setting(tmp_path: Path) -> None:
    done = metanode("serve", "--data-dir", str(tmp_path / "data"), env={"METANODE_PORT": "99999"})
    assert done.returncode == 2
    assert done.stderr.startswith(
        "error: invalid_request: setting port: 99999 is not from 1 to 65535"
    ), done.stderr
    assert not (tmp_path / "data").exists()


def test_serve_names_the_watched_roots(server: Server) -> None:
    deadline = time.monotonic() + 30
    while "watching:" not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"watching: {server.media.resolve()}" in server.log_text()
    # and which databases it serves (after migrate-storage, a start without `storage` serves
    # the old SQLite files: this line shows it)
    assert f"(data: {server.data_dir.resolve()}, storage: sqlite, workers: 1)" in server.log_text()


def test_a_node_that_takes_the_request_and_answers_late_is_not_called_unreachable() -> None:
    """A node still working when the client stops waiting (a `peers sync` of a large box) was
    "unreachable: no node answers at …: timed out", and told to be named with --url."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    taker = threading.Thread(target=lambda: held.append(listener.accept()[0]), daemon=True)
    taker.start()
    port = listener.getsockname()[1]
    try:
        with (
            client.Client(f"http://127.0.0.1:{port}", timeout=0.5) as slow,
            pytest.raises(errors.AnswerTimedOut) as caught,
        ):
            slow.request("POST", "/api/peers/a/sync")
        assert caught.value.message == (
            f"the node at http://127.0.0.1:{port} took longer than 0.5 s to answer POST "
            "/api/peers/a/sync: it may still be doing it (see its log or /health)"
        )
    finally:
        for conn in held:
            conn.close()
        listener.close()


def test_health_says_how_the_node_is_and_exits_by_it(tmp_path: Path) -> None:
    """An operator in a terminal (or cron) had `curl /health | jq` and a port to remember:
    `metanode health` finds the node from the same settings as `serve` (METANODE_PORT here),
    prints its status, then each problem and warning on a line, and exits 0 if ok, 1 if
    degraded, 2 if nothing answers."""
    (tmp_path / "media").write_text("a file where the watched folder should be")
    server = Server(tmp_path / "data").start()  # its watch root is ../media: degraded
    try:
        env = {"METANODE_PORT": str(server.port)}
        degraded = metanode("health", env=env)
        assert degraded.returncode == 1, degraded
        lines = degraded.stdout.splitlines()
        assert lines[0] == f"degraded (http://127.0.0.1:{server.port})"
        assert lines[1].startswith("  problem: cannot read 1 watched folder(s) "), lines
        assert str(tmp_path / "media") in lines[1]
    finally:
        server.stop()
    (tmp_path / "media").unlink()
    (tmp_path / "media").mkdir()
    server.start()
    try:
        ok = metanode("health", env={"METANODE_PORT": str(server.port)})
        assert (ok.returncode, ok.stdout) == (0, f"ok (http://127.0.0.1:{server.port})\n"), ok
    finally:
        server.stop()
    gone = metanode("health", env={"METANODE_PORT": str(server.port)})
    assert gone.returncode == 2 and gone.stderr.startswith("error: unreachable: "), gone


def test_a_node_on_another_port_is_found_by_its_data_directory(tmp_path: Path) -> None:
    """`serve --port P` (or a METANODE_PORT only its own shell has) sent every client command
    to the default port's `unreachable`: the node records where it listens in its data directory
    (`serving`), so the commands given only that directory ask there; two nodes on two data
    directories are each found, one of them `--workers 2`. `--url` still comes first."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = Server(tmp_path / "one" / "data").start()
    two = Server(tmp_path / "two" / "data", workers=2).start()
    try:
        for srv in (one, two):
            assert srv.port != 9000
            assert (srv.data_dir / "serving").read_text() == f"{srv.url}\n"
            found = metanode("health", "--data-dir", str(srv.data_dir))
            assert (found.returncode, found.stdout) == (0, f"ok ({srv.url})\n"), found
        alice = Signer()
        two.register(alice.uid, "alice")
        env = {"METANODE_DATA_DIR": str(two.data_dir)}  # the token read from there too
        claim = json.dumps(alice.claim(MIDHASH, "title", "Found"))
        assert metanode("claim", "post", claim, env=env).returncode == 0
        assert json.loads(metanode("get", MIDHASH, env=env).stdout)["metadata"]["title"] == "Found"

        nothing = f"http://127.0.0.1:{free_port()}"
        given = metanode("health", "--data-dir", str(one.data_dir), "--url", nothing)
        assert given.stderr.startswith(f"error: unreachable: no node answers at {nothing}: ")
        assert "Connection refused (from --url); " in given.stderr, given.stderr
    finally:
        one.stop()
        two.stop()
    for srv in (one, two):  # a clean stop takes the record away
        assert not (srv.data_dir / "serving").exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_record_its_node_outlived_is_not_followed(tmp_path: Path, workers: int) -> None:
    """A node killed (SIGKILL: no stop of its own) leaves its record, whose address may answer
    something else by then: here a listener that never answers, where a client following the
    record would wait its full 60 s. Nobody holds the record's lock any more, so no node serves
    this data directory: the command asks neither the record's address nor the settings' one,
    where another node answers (read or written, it would be the wrong node's answer), and
    says the node is not running; `get --wait` waits for it, and finds it once it is started
    again, on another port, by the record its start writes."""
    srv = Server(tmp_path / "data", workers=workers).start()
    srv.stop(signal.SIGKILL)
    assert (srv.data_dir / "serving").read_text() == f"{srv.url}\n"
    listener = poll(lambda: squat(srv.port), f"port {srv.port} let go by the killed node")
    other = Server(tmp_path / "other").start()
    try:
        done = metanode(
            "health", "--data-dir", str(srv.data_dir), env={"METANODE_PORT": str(other.port)}
        )
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody knocked at the record's address
        assert "GET /health" not in other.log_text()
    finally:
        listener.close()
        other.stop()
    assert (done.returncode, done.stdout) == (2, ""), done
    assert done.stderr.startswith(
        f"error: unreachable: no node answers at {srv.url}: the node that recorded it is not "
        f"running (recorded in {srv.data_dir} by a node killed or crashed since; not asked, "
        "nor the settings' address: "
    ), done.stderr

    srv.port = free_port()
    get = ["get", MIDHASH, "--wait", "100", "--data-dir", str(srv.data_dir)]
    waiting = subprocess.Popen(
        [sys.executable, "-m", "metanode", *get],
        env={k: v for k, v in os.environ.items() if not k.startswith("METANODE_")},
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert waiting.stderr is not None
        said = waiting.stderr.readline()
        assert said.startswith("waiting up to 100 s: no node answers at "), said
        assert "the node that recorded it is not running" in said, said
        srv.start()
        alice = Signer()
        srv.register(alice.uid, "alice")
        claim = json.dumps(alice.claim(MIDHASH, "title", "Back"))
        posted = metanode("claim", "post", "--data-dir", str(srv.data_dir), stdin=claim)
        assert posted.returncode == 0, posted
        out, _ = waiting.communicate(timeout=120)
        assert (waiting.returncode, json.loads(out)["metadata"]["title"]) == (0, "Back"), out
        found = metanode("health", "--data-dir", str(srv.data_dir))
        assert (found.returncode, found.stdout) == (0, f"ok ({srv.url})\n"), found
    finally:
        waiting.kill()
        waiting.wait()
        srv.stop()


def squat(port: int) -> socket.socket | None:
    """A listener on `port` that never accepts (the kernel still completes connections), or
    None while the port is still held."""
    try:
        return socket.create_server(("127.0.0.1", port))
    except OSError:
        return None
