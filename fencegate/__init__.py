"""fencegate: idempotency keys and fencing tokens for side effects.

The receiver half (`FencegateMiddleware`, `fencegate serve`) and the worker half
(`fencegate.lease`) speak one protocol; see docs/protocol.md, and the documentation site
built from docs/.
"""

from typing import TYPE_CHECKING, Any

from fencegate.errors import FencegateError, StoreUnavailable

__version__ = "1.0.0"

if TYPE_CHECKING:
    from fencegate.gateway.middleware import FenceGateMiddleware, FencegateMiddleware

__all__ = [
    "FenceGateMiddleware",
    "FencegateError",
    "FencegateMiddleware",
    "StoreUnavailable",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # Imported lazily so that `import fencegate.lease` in a worker does not pull in the gateway.
    # `FenceGateMiddleware` is the spelling of the design contract (DESIGN §4).
    if name in ("FencegateMiddleware", "FenceGateMiddleware"):
        from fencegate.gateway import middleware

        return getattr(middleware, name)
    raise AttributeError(name)
