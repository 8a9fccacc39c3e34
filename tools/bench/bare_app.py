"""The read benchmark's baseline: a bare Starlette app with one JSON endpoint, served like metanode.

Run: `.venv/bin/python tools/bench/bare_app.py --port P [--log-level info]`.

`GET /api/meta/{cid}` answers a small constant dict (the path parameter is parsed by the router,
as metanode's route does, and ignored). `POST /api/claims` (the ingest floor of `floor.py`)
reads and parses the JSON body and answers a constant dict of the shape metanode answers. No
middleware, no database, no access log of its own.
`main` mirrors what `metanode serve` does around its app (metanode/cli.py): the same process-wide
logging set-up (`metanode.logs.configure(log_level)`: one stderr handler, JSON lines), then
`uvicorn.run(app, host, port, log_level, timeout_graceful_shutdown=10, access_log=False,
log_config=None)` with uvicorn's defaults for everything else (loop and http "auto", i.e.
uvloop and httptools when installed). metanode's own per-request work (its access log line,
request id and latency histogram, CORS, the perimeter, and its bounded httptools protocol,
metanode/server.py) is part of what the benchmark measures, so none of it is copied here.
Keep the two in step when `metanode serve` changes.
"""

from __future__ import annotations

import argparse
import sys

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from metanode import logs

BODY = {"cid": "bare", "metadata": {"title": "constant"}}
POSTED = {"results": [{"status": "accepted"}], "accepted": 1, "duplicate": 0, "stale": 0}


async def meta(request: Request) -> Response:
    return JSONResponse(BODY)


async def post_claims(request: Request) -> Response:
    await request.json()
    return JSONResponse(POSTED)


app = Starlette(
    routes=[Route("/api/meta/{cid}", meta), Route("/api/claims", post_claims, methods=["POST"])]
)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log-level", default="info", help="as metanode's log_level setting")
    args = parser.parse_args(argv)
    logs.configure(args.log_level)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=10,
        access_log=False,
        log_config=None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
