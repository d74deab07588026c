"""How a machine's file errors read in lcsm's messages, for every layer (tasks warn, the engine
and the CLI refuse)."""

from __future__ import annotations

import errno


def os_error_cause(err: OSError) -> str:
    """The cause of ``err`` in a few words: "disk full" for ENOSPC, else the system's own words."""
    return "disk full" if err.errno == errno.ENOSPC else (err.strerror or str(err))
