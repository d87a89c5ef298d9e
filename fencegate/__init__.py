"""fencegate: idempotency keys and fencing tokens for side effects.

The receiver half (`FenceGateMiddleware`, `fencegate serve`) and the worker half
(`fencegate.lease`) speak one protocol; see the README.
"""

from typing import TYPE_CHECKING, Any

from fencegate.errors import FencegateError, StoreUnavailable

__version__ = "0.1.0"

if TYPE_CHECKING:
    from fencegate.gateway.middleware import FenceGateMiddleware

__all__ = ["FenceGateMiddleware", "FencegateError", "StoreUnavailable", "__version__"]


def __getattr__(name: str) -> Any:
    # Imported lazily so that `import fencegate.lease` in a worker does not pull in the gateway.
    if name == "FenceGateMiddleware":
        from fencegate.gateway.middleware import FenceGateMiddleware

        return FenceGateMiddleware
    raise AttributeError(name)
