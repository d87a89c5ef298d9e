"""RFC 9421 request signatures with RFC 9530 content digests: the key ring the gateway trusts,
the check it runs before anything else, and the signer workers use.

Workers sign with :class:`HttpSigner`; the gateway calls :func:`load_authenticator` once at
start-up.
"""

from __future__ import annotations

from fencegate.signing.keys import KeyConfigError, KeyRing, load_keys
from fencegate.signing.loader import load_authenticator
from fencegate.signing.sign import HttpSigner, covered_components
from fencegate.signing.verify import STRIPPED_HEADERS, SignatureAuthenticator

__all__ = [
    "STRIPPED_HEADERS",
    "HttpSigner",
    "KeyConfigError",
    "KeyRing",
    "SignatureAuthenticator",
    "covered_components",
    "load_authenticator",
    "load_keys",
]
