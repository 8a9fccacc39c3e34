"""`python -m metanode` and the `metanode` script: the command line (`metanode.cli`), whose
imports take a second or more on a small box; a Ctrl-C meanwhile ends it as every other Ctrl-C
does (`errors.INTERRUPTED`), not with the traceback of whichever module was being imported."""

import sys

from metanode.errors import INTERRUPTED, INTERRUPTED_LINE


def run() -> None:
    """Import the command line, then run it."""
    try:
        from metanode.cli import main
    except KeyboardInterrupt:
        print(f"\n{INTERRUPTED_LINE}", file=sys.stderr)
        sys.exit(INTERRUPTED)
    main()


if __name__ == "__main__":  # not when a `spawn` worker process imports it
    run()
