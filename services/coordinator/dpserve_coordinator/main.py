"""`dpserve-coordinator`: the process entry point. Flags and settings in settings.py; the process in server.py."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from dpserve_shared.zmq_security import CLUSTER_KEY_ENV, log_security

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
    log_security(logging.getLogger("dpserve.coordinator"), settings.zmq_security)
    # The settings hold the key and the launchers hand it to each engine; a local Ray instance started here (its
    # raylet, its workers) inherits this environment and has no use for it.
    os.environ.pop(CLUSTER_KEY_ENV, None)
    from dpserve_coordinator.server import Coordinator  # zmq and the launchers: not needed for --help

    code = asyncio.run(Coordinator(settings).run())
    ray_backend = sys.modules.get("dpserve_coordinator.ray_backend")
    if ray_backend is not None and ray_backend.cluster_lost():
        # Ray's exit hook (ray.shutdown) would flush task events and metrics to the dead cluster for ~25 s.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
