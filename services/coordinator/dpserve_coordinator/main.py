"""`dpserve-coordinator`: the process entry point. Flags and settings in settings.py; the process in server.py."""

from __future__ import annotations

import asyncio
import logging
import sys

from dpserve_coordinator.settings import build_parser, settings_from_args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s", stream=sys.stderr
    )
    from dpserve_coordinator.server import Coordinator  # zmq and the launchers: not needed for --help

    return asyncio.run(Coordinator(settings).run())


if __name__ == "__main__":
    sys.exit(main())
