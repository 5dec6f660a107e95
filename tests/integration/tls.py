"""A self-signed certificate for loopback, for the tests that run Valkey over TLS."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """(cert, key) for 127.0.0.1, valid a day; the test is skipped where openssl is missing."""
    if not shutil.which("openssl"):
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key
