"""The gateway's step 1 from configuration: the key ring read from a file, the environment or
a table, turned into the authenticator the gateway calls once at start-up."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fencegate.signing.keys import KeyConfigError, LoadedKeys, load_keys
from fencegate.signing.verify import SignatureAuthenticator
from fencegate.types import Authenticator

logger = logging.getLogger("fencegate.signing")


def load_authenticator(
    spec: str | os.PathLike[str] | Mapping[str, Any] | list[Any] | None,
    *,
    skew_past: float = 60,
    skew_future: float = 5,
    public_base_url: str | None = None,
    base_dir: Path | None = None,
    store_timeout: float = 5.0,
) -> Authenticator | None:
    """The gateway's signature check, or ``None`` (single tenant) when no keys are given.

    ``spec`` is a path to a keys file (TOML, or JSON), the parsed ``[keys]`` section of the
    config file (a table or a list of key tables), or the value of ``FENCEGATE_KEYS``: a
    path, or the document itself when it starts with ``{`` or ``[`` or spans several lines.
    Settings written in the keys document (``public_base_url``, ``skew_past_seconds``,
    ``skew_future_seconds``) win over the keyword defaults. ``store_timeout`` bounds the
    nonce write. Raises :class:`KeyConfigError`
    (a ``ValueError``) naming the entry and field of a bad key.
    """
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        logger.warning(
            "no signing keys configured: requests are not authenticated and every key "
            "and fence belongs to the single default tenant"
        )
        return None
    loaded: LoadedKeys = load_keys(spec, base_dir=base_dir)
    if len(loaded.ring) == 0:
        raise KeyConfigError("keys: the key list is empty; remove the setting to run unsigned")
    authenticator = SignatureAuthenticator(
        loaded.ring,
        skew_past=loaded.skew_past_seconds or skew_past,
        skew_future=(
            loaded.skew_future_seconds if loaded.skew_future_seconds is not None else skew_future
        ),
        public_base_url=loaded.public_base_url or public_base_url,
        store_timeout=store_timeout,
    )
    logger.info(
        "signatures required: %d keys for %d tenants", len(loaded.ring), len(loaded.ring.tenants)
    )
    return authenticator
