"""`fencegate sign`: sign one request for curl users and for checking another language's
signer against ours (``--show-base`` prints the exact signature base)."""

from __future__ import annotations

import argparse
import base64
import os
import shlex
import sys
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from fencegate.errors import CommandError
from fencegate.signing.keys import ALGORITHMS, KeyConfigError
from fencegate.signing.sign import HttpSigner

ENV_PREFIX = "FENCEGATE_SIGNING_"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", nargs="?", help="the URL the request is sent to")
    parser.add_argument("-X", "--request", dest="method", default=None, help="method (GET)")
    parser.add_argument(
        "-H",
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="a header to send (repeatable)",
    )
    parser.add_argument(
        "-d",
        "--data",
        default=None,
        help="the body; @FILE reads a file, @- standard input (default method then POST)",
    )
    parser.add_argument("--idempotency-key", help="sets Idempotency-Key")
    parser.add_argument("--fence", help="sets X-Execution-Fence")
    parser.add_argument("--entity", help="sets X-Execution-Entity")
    parser.add_argument(
        "--key-id",
        default=os.environ.get(ENV_PREFIX + "KEY_ID"),
        help="env FENCEGATE_SIGNING_KEY_ID",
    )
    parser.add_argument(
        "--alg",
        choices=ALGORITHMS,
        default=os.environ.get(ENV_PREFIX + "ALG"),
        help="env FENCEGATE_SIGNING_ALG (default: what the key file holds: a PEM private key "
        "is ed25519, anything else hmac-sha256)",
    )
    parser.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        help="HMAC secret (base64) or Ed25519 private key (PEM or base64 seed); "
        "else env FENCEGATE_SIGNING_SECRET or FENCEGATE_SIGNING_SECRET_FILE",
    )
    parser.add_argument(
        "--digest", choices=("sha-256", "sha-512"), default="sha-256", help="Content-Digest"
    )
    parser.add_argument("--curl", action="store_true", help="print a curl command line")
    parser.add_argument(
        "--show-base", action="store_true", help="also print the signature base (to stderr)"
    )
    parser.add_argument(
        "--new-key",
        choices=ALGORITHMS,
        default=None,
        help="instead of signing: create a key, write it to --secret-file (mode 0600) and "
        "print the [[keys]] entry for the gateway (needs --key-id and --tenant)",
    )
    parser.add_argument("--tenant", help="with --new-key: the tenant the key speaks for")


def run(args: argparse.Namespace) -> int:
    if not args.key_id:
        raise CommandError("--key-id (or FENCEGATE_SIGNING_KEY_ID) is required")
    if args.new_key:
        return _new_key(args)
    if not args.url:
        raise CommandError("a URL is required")
    signer = _signer(args)
    headers = _headers(args)
    body = _body(args.data)
    method = (args.method or ("POST" if args.data is not None else "GET")).upper()
    try:
        prepared = signer.prepare_and_sign(method, args.url, headers, body)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    if args.show_base:
        print(prepared.signature_base.decode("ascii"), file=sys.stderr)
    if args.curl:
        print(_curl(method, args.url, headers, args.data))
    else:
        for name, value in headers.items():
            print(f"{name}: {value}")
    return 0


def _signer(args: argparse.Namespace) -> HttpSigner:
    if args.secret_file is not None:
        path: str | None = str(args.secret_file)
        inline = None
    else:
        path = os.environ.get(ENV_PREFIX + "SECRET_FILE")
        inline = os.environ.get(ENV_PREFIX + "SECRET")
    if path is None and inline is None:
        raise CommandError(
            "no key: give --secret-file, or set FENCEGATE_SIGNING_SECRET(_FILE); "
            "a secret on the command line would show in the process list"
        )
    try:
        material = Path(path).read_bytes() if path is not None else str(inline).encode()
    except OSError as exc:
        raise CommandError(f"cannot read the key file {path}: {exc.strerror}") from None
    alg = algorithm_of(material, asked=args.alg)
    try:
        return HttpSigner.from_material(
            key_id=args.key_id, alg=alg, material=material, digest=args.digest
        )
    except (ValueError, KeyConfigError) as exc:
        raise CommandError(f"the {alg} key {exc}") from None


def algorithm_of(material: bytes, *, asked: str | None) -> str:
    """The algorithm the key file says it is for (a PEM private key is Ed25519, as
    ``--new-key ed25519`` writes it); a contradicting ``--alg`` is refused rather than
    signing with the PEM text as an HMAC secret."""
    pem = b"-----BEGIN" in material and b"PRIVATE KEY-----" in material
    held = "ed25519" if pem else None
    if asked is None:
        return held or "hmac-sha256"
    if held is not None and asked != held:
        raise CommandError(
            f"the key file holds an {held} private key (PEM), not an {asked} secret: "
            f"give --alg {held}, or leave --alg out"
        )
    return asked


def _headers(args: argparse.Namespace) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in args.header:
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise CommandError(f"header {line!r} is not 'Name: value'")
        headers[name.strip()] = value.strip()
    for name, value in (
        ("Idempotency-Key", args.idempotency_key),
        ("X-Execution-Fence", args.fence),
        ("X-Execution-Entity", args.entity),
    ):
        if value is not None:
            headers[name] = value
    return headers


def _body(data: str | None) -> bytes:
    if data is None:
        return b""
    if data == "@-":
        return sys.stdin.buffer.read()
    if data.startswith("@"):
        try:
            return Path(data[1:]).read_bytes()
        except OSError as exc:
            raise CommandError(f"cannot read {data[1:]}: {exc.strerror}") from None
    return data.encode()


def _curl(method: str, url: str, headers: dict[str, str], data: str | None) -> str:
    parts = ["curl", "-sS", "-X", method]
    for name, value in headers.items():
        parts += ["-H", f"{name}: {value}"]
    if data is not None:
        # --data-binary sends the bytes as they are: the digest was computed over exactly them.
        parts += ["--data-binary", data]
    parts.append(url)
    return " ".join(shlex.quote(p) for p in parts)


def _new_key(args: argparse.Namespace) -> int:
    if not args.tenant or args.secret_file is None:
        raise CommandError("--new-key needs --tenant and --secret-file (where the key goes)")
    path: Path = args.secret_file
    if path.exists():
        raise CommandError(f"{path} exists; refusing to overwrite a key")
    if args.new_key == "hmac-sha256":
        secret = base64.b64encode(os.urandom(32))
        material, entry_key = secret + b"\n", f'secret_file = "{path.resolve()}"'
    else:
        private = ed25519.Ed25519PrivateKey.generate()
        material = private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        public = private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        entry_key = f'public_key = "{base64.b64encode(public).decode()}"'
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(material)
    print("[[keys]]")
    print(f'id = "{args.key_id}"')
    print(f'tenant = "{args.tenant}"')
    print(f'alg = "{args.new_key}"')
    print(entry_key)
    return 0
