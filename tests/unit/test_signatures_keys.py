"""Key files: what the gateway trusts, and how a bad file is refused."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from fencegate.signing import KeyConfigError, SignatureAuthenticator, load_authenticator

SECRET = base64.b64encode(b"s" * 32).decode()
PRIVATE = ed25519.Ed25519PrivateKey.from_private_bytes(b"e" * 32)
PUBLIC_PEM = PRIVATE.public_key().public_bytes(
    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
)


def load(spec: object, **kwargs: object) -> SignatureAuthenticator:
    auth = load_authenticator(spec, **kwargs)  # type: ignore[arg-type]
    assert isinstance(auth, SignatureAuthenticator)
    return auth


def refused(spec: object) -> str:
    with pytest.raises(KeyConfigError) as caught:
        load_authenticator(spec)  # type: ignore[arg-type]
    message = str(caught.value)
    assert SECRET not in message
    return message


def test_toml_file_with_files_relative_to_it(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "acme.secret").write_text(SECRET + "\n")
    (tmp_path / "keys" / "globex.pem").write_bytes(PUBLIC_PEM)
    keys = tmp_path / "keys.toml"
    keys.write_text(
        'public_base_url = "https://api.example.com"\n'
        "skew_past_seconds = 120\n"
        "[[keys]]\n"
        'id = "acme-1"\ntenant = "acme"\nalg = "hmac-sha256"\nsecret_file = "keys/acme.secret"\n'
        "[[keys]]\n"
        'id = "globex-1"\ntenant = "globex"\nalg = "ed25519"\npublic_key_file = "keys/globex.pem"\n'
    )
    auth = load(str(keys))
    assert auth.public_base_url == "https://api.example.com"
    assert auth.skew_past == 120 and auth.skew_future == 5
    assert {(k.key_id, k.tenant, k.alg) for k in auth.keys} == {
        ("acme-1", "acme", "hmac-sha256"),
        ("globex-1", "globex", "ed25519"),
    }


def test_inline_json_and_toml_as_in_the_environment_variable() -> None:
    entry = {"id": "k", "tenant": "t", "alg": "hmac-sha256", "secret": SECRET}
    assert load(json.dumps([entry])).keys.get("k") is not None
    assert load(json.dumps({"keys": [entry]})).keys.get("k") is not None
    toml = f'[[keys]]\nid = "k"\ntenant = "t"\nalg = "hmac-sha256"\nsecret = "{SECRET}"\n'
    assert load(toml).keys.get("k") is not None


def test_config_section_as_list_or_as_table_pointing_at_a_file(tmp_path: Path) -> None:
    entry = {"id": "k", "tenant": "t", "alg": "hmac-sha256", "secret": SECRET}
    assert load([entry]).keys.get("k") is not None
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [entry]}))
    assert load({"file": "keys.json"}, base_dir=tmp_path).keys.get("k") is not None


def test_no_keys_means_single_tenant(caplog: pytest.LogCaptureFixture) -> None:
    assert load_authenticator(None) is None
    assert load_authenticator("  ") is None
    assert "single default tenant" in caplog.text


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"tenant": "t", "alg": "hmac-sha256", "secret": SECRET}, "entry 1: field 'id'"),
        (
            {"id": "k", "tenant": "t", "alg": "rsa", "secret": SECRET},
            "entry 1 (id 'k'): field 'alg'",
        ),
        (
            {"id": "k", "tenant": "t", "alg": "hmac-sha256", "secret": SECRET, "colour": "red"},
            "field 'colour'",
        ),
        (
            {"id": "k", "tenant": "t", "alg": "hmac-sha256", "secret": "not base64!"},
            "field 'secret' is not valid base64",
        ),
        (
            {"id": "k", "tenant": "t", "alg": "hmac-sha256", "secret": "c2hvcnQ="},
            "field 'secret' must decode to at least 32 bytes",
        ),
        ({"id": "k", "tenant": "t", "alg": "hmac-sha256"}, "exactly one of secret or secret_file"),
        (
            {"id": "k", "tenant": "t", "alg": "ed25519", "public_key": SECRET, "secret": SECRET},
            "secret does not apply to ed25519",
        ),
        (
            {"id": "k", "tenant": "t", "alg": "ed25519", "public_key": "AAAA"},
            "field 'public_key' must be 32 bytes",
        ),
        (
            {"id": "k", "tenant": "t", "alg": "hmac-sha256", "secret_file": "/nonexistent/secret"},
            "field 'secret_file' cannot be read",
        ),
        ({"id": "has space", "tenant": "t", "alg": "hmac-sha256", "secret": SECRET}, "field 'id'"),
    ],
)
def test_a_bad_entry_is_refused_naming_entry_and_field(
    entry: dict[str, str], expected: str
) -> None:
    assert expected in refused([entry])


def test_duplicate_ids_and_empty_lists_are_refused() -> None:
    entry = {"id": "k", "tenant": "t", "alg": "hmac-sha256", "secret": SECRET}
    assert "entry 2 (id 'k'): field 'id' repeats entry 1" in refused([entry, entry])
    assert "empty" in refused([])


def test_unreadable_and_malformed_files_are_refused(tmp_path: Path) -> None:
    assert "No such file" in refused(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[[keys]\n")
    assert "not valid TOML or JSON" in refused(str(bad))
