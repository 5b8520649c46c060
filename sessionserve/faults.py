"""Fault points for chaos tests: `SESSIONSERVE_FAULTS=name[,name...]` in a replica's
environment makes its process exit at the named points (as a node loss would), so tests can
kill a replica at an exact step of a protocol instead of racing a `ray.kill`. Unset (always,
outside tests), a fault point costs one environment lookup."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
FAULT_EXIT_CODE = 17


def fault_point(name: str) -> None:
    if name in os.environ.get("SESSIONSERVE_FAULTS", "").split(","):
        log.error("fault point %r reached: exiting (SESSIONSERVE_FAULTS)", name)
        logging.shutdown()
        os._exit(FAULT_EXIT_CODE)
