"""asyncpg's pool, in one line per event.

While the database is gone (dropped, unreachable), asyncpg's pool keeps trying to restore its
minimum size and logs each failure with a 20-line traceback: an operator watching the log
during an outage saw nothing else. The fault is the database's, not a bug: one line naming
it is what the log needs, and the gateway's own lines (503 store-unavailable, /healthz) say
the rest.
"""

from __future__ import annotations

import logging

POOL_LOGGER = "asyncpg.pool"


class OneLineFaults(logging.Filter):
    """Folds a record's traceback into its message: ``…; retrying: InvalidCatalogNameError:
    database "x" does not exist``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage()}: {type(exc).__name__}: {exc}".replace("\n", " ")
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def install() -> None:
    """Once per process; a second call adds nothing."""
    logger = logging.getLogger(POOL_LOGGER)
    if not any(isinstance(f, OneLineFaults) for f in logger.filters):
        logger.addFilter(OneLineFaults())
