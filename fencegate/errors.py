"""The root of every error fencegate raises on purpose: ``except FencegateError`` catches
them all (store trouble, a refused configuration, lost ownership, an error answer)."""

from __future__ import annotations


class FencegateError(Exception):
    """Base class of every fencegate error."""


class StoreUnavailable(FencegateError):
    """The store did not answer in time, could not be reached, or failed in any other way (a
    driver, protocol or schema error). The gateway fails closed (503); a worker treats its
    ownership as unknown, not lost."""

    # Whether the call may have reached the store, and so may still take effect there after
    # its caller stopped waiting (False: it failed before it was sent).
    reached_store: bool = True


def unsent(error: StoreUnavailable) -> StoreUnavailable:
    """``error``, marked as raised before the call was sent."""
    error.reached_store = False
    return error


class StoreTimedOut(StoreUnavailable):
    """The store did not answer within the caller's timeout (which the message names)."""


class StoreClosed(StoreUnavailable):
    """This process closed its connection to the store: nothing more is sent, so nothing is
    worth trying again (a write kept trying in the background stops)."""

    reached_store = False


class CommandError(FencegateError):
    """A user-facing failure of a ``fencegate`` command: printed as one clear line, exit
    status 2."""
