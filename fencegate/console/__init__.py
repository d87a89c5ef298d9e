"""`fencegate console`: the operator's web console over the same reads and actions as the
command line, behind a token. Mount it anywhere as an ASGI app::

    from fencegate.console import create_console_app
    app = create_console_app("postgresql://…", tokens=load_tokens("tokens.toml", os.environ))
"""

from fencegate.console.app import create_console_app
from fencegate.console.auth import ConsoleToken, TokenConfigError, load_tokens

__all__ = ["ConsoleToken", "TokenConfigError", "create_console_app", "load_tokens"]
