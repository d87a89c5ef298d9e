"""`fencegate sign`: keys it creates are ones the gateway loads, headers it prints verify."""

from __future__ import annotations

import argparse
import shlex
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fencegate.cli import CommandError
from fencegate.commands import sign
from fencegate.signing import SignatureAuthenticator, load_authenticator
from fencegate.store import GatewayStore, open_gateway_store
from fencegate.types import IncomingRequest

URL = "http://127.0.0.1:8080/v1/cases?customer=c-1048"


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fencegate sign")
    sign.add_arguments(parser)
    return sign.run(parser.parse_args(argv))


@pytest.fixture
async def store(sqlite_url: str) -> AsyncIterator[GatewayStore]:
    gateway_store = await open_gateway_store(sqlite_url, run_migrations=False)
    try:
        yield gateway_store
    finally:
        await gateway_store.close()


def new_key(tmp_path: Path, alg: str, capsys: pytest.CaptureFixture[str]) -> tuple[Path, Path]:
    secret = tmp_path / f"{alg}.key"
    assert (
        run(
            [
                "--new-key",
                alg,
                "--key-id",
                f"k-{alg}",
                "--tenant",
                "acme",
                "--secret-file",
                str(secret),
            ]
        )
        == 0
    )
    keys = tmp_path / f"keys-{alg}.toml"
    keys.write_text(capsys.readouterr().out)
    return secret, keys


def parse_headers(text: str) -> list[tuple[str, str]]:
    return [
        (n.lower(), v.strip()) for n, _, v in (line.partition(":") for line in text.splitlines())
    ]


@pytest.mark.parametrize("alg", ["hmac-sha256", "ed25519"])
@pytest.mark.parametrize("say_alg", [True, False], ids=["--alg", "alg-from-key-file"])
async def test_a_new_key_signs_requests_the_gateway_accepts(
    tmp_path: Path,
    alg: str,
    say_alg: bool,
    capsys: pytest.CaptureFixture[str],
    store: GatewayStore,
) -> None:
    """With or without ``--alg``: the key file says what it is (a PEM key is Ed25519)."""
    secret, keys = new_key(tmp_path, alg, capsys)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert secret.read_bytes().strip().decode() not in keys.read_text()  # the entry names the file
    auth = load_authenticator(str(keys))
    assert isinstance(auth, SignatureAuthenticator)

    argv = ["--key-id", f"k-{alg}", "--secret-file", str(secret), "-d", '{"a":1}']
    argv += ["--alg", alg] if say_alg else []
    argv += [
        "--idempotency-key",
        "job:1:create",
        "--fence",
        "7",
        "--entity",
        "job:1",
        "--show-base",
        URL,
    ]
    assert run(argv) == 0
    captured = capsys.readouterr()
    headers = parse_headers(captured.out)
    assert [name for name, _ in headers] == [
        "idempotency-key",
        "x-execution-fence",
        "x-execution-entity",
        "content-digest",
        "signature-input",
        "signature",
    ]
    base = captured.err.splitlines()
    assert base[0] == '"@method": POST'
    assert base[1] == f'"@target-uri": {URL}'
    assert base[-1] == '"@signature-params": ' + dict(headers)["signature-input"].removeprefix(
        "sig1="
    )
    request = IncomingRequest(
        method="POST",
        scheme="http",
        authority="127.0.0.1:8080",
        path="/v1/cases",
        query_string="customer=c-1048",
        headers=tuple(headers),
        body=b'{"a":1}',
    )
    assert await auth.authenticate(request, store) == "acme"


def test_an_alg_the_key_file_contradicts_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret, _ = new_key(tmp_path, "ed25519", capsys)
    argv = ["--key-id", "k-ed25519", "--alg", "hmac-sha256", "--secret-file", str(secret), URL]
    with pytest.raises(CommandError) as refused:
        run(argv)
    assert "holds an ed25519 private key (PEM)" in str(refused.value)
    assert "--alg ed25519" in str(refused.value)
    assert capsys.readouterr().out == ""  # nothing signed


def test_curl_output_carries_the_signed_headers_and_body(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret, _ = new_key(tmp_path, "hmac-sha256", capsys)
    body = tmp_path / "body.json"
    body.write_bytes(b'{"title": "it\'s a refund"}\n')
    run(
        ["--key-id", "k-hmac-sha256", "--secret-file", str(secret), "-d", f"@{body}", "--curl", URL]
    )
    words = shlex.split(capsys.readouterr().out)
    assert words[:4] == ["curl", "-sS", "-X", "POST"]
    assert words[-1] == URL
    assert words[words.index("--data-binary") + 1] == f"@{body}"
    sent = [words[i + 1] for i, w in enumerate(words) if w == "-H"]
    assert any(h.startswith("Signature-Input: sig1=(") for h in sent)


def test_secret_from_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret, _ = new_key(tmp_path, "hmac-sha256", capsys)
    monkeypatch.setenv("FENCEGATE_SIGNING_SECRET", secret.read_text().strip())
    assert run(["--key-id", "k-hmac-sha256", URL]) == 0
    assert 'keyid="k-hmac-sha256"' in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--secret-file", "/nonexistent", URL], "--key-id"),
        (["--key-id", "k", "--secret-file", "/nonexistent/key", URL], "cannot read the key file"),
        (["--key-id", "k", "--new-key", "ed25519"], "--new-key needs --tenant and --secret-file"),
        (
            ["--key-id", "k", "--secret-file", "/dev/null", "-H", "no colon", URL],
            "is not 'Name: value'",
        ),
    ],
)
def test_mistakes_are_one_clear_line(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("FENCEGATE_SIGNING_KEY_ID", raising=False)
    key = tmp_path / "k.key"
    key.write_text("c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0\n")
    argv = [str(key) if a == "/dev/null" else a for a in argv]
    with pytest.raises(CommandError, match=message):
        run(argv)


def test_no_key_material_anywhere_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SECRET", "SECRET_FILE"):
        monkeypatch.delenv(f"FENCEGATE_SIGNING_{name}", raising=False)
    with pytest.raises(CommandError, match="would show in the process list"):
        run(["--key-id", "k", URL])


def test_existing_key_files_are_never_overwritten(tmp_path: Path) -> None:
    existing = tmp_path / "k.key"
    existing.write_text("keep me")
    with pytest.raises(CommandError, match="refusing to overwrite"):
        run(
            [
                "--new-key",
                "hmac-sha256",
                "--key-id",
                "k",
                "--tenant",
                "t",
                "--secret-file",
                str(existing),
            ]
        )
    assert existing.read_text() == "keep me"
