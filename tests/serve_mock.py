"""Runs the real `run_server` with the mock engine, for the SIGTERM drain test:
    python tests/serve_mock.py [DELAY_SECONDS_PER_TOKEN [GRACE_SECONDS]]
prints `Server ready on http://127.0.0.1:PORT` (a random port), serves until SIGTERM/SIGINT,
drains, prints `drained: N finished, M aborted` and exits 0."""
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mock_engine import MockEngine  # noqa: E402

from maxjax.server.app import run_server  # noqa: E402
from maxjax.server.config import ServeConfig  # noqa: E402


def main() -> int:
    engine = MockEngine(delay=float(sys.argv[1]) if len(sys.argv) > 1 else 0.0)
    grace = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
    asyncio.run(run_server(engine, ServeConfig(port=0, shutdown_grace_period=grace)))
    print(f"drained: {len(engine.finished)} finished, {len(engine.aborted)} aborted", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
