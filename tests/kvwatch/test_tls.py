"""/metrics over TLS with client-certificate auth (real HTTP, real handshake)."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.kvwatch.daemonproc import DaemonProcess

TLS = Path(__file__).parent / "tls"


def test_metrics_over_tls_require_a_client_certificate(tmp_path: Path) -> None:
    config = tmp_path / "kvwatch.toml"
    config.write_text(
        f'tls_cert_file = "{TLS / "server.crt"}"\n'
        f'tls_key_file = "{TLS / "server.key"}"\n'
        f'tls_client_ca_file = "{TLS / "ca.crt"}"\n'
    )
    daemon = DaemonProcess(tmp_path, "--config", str(config), "--no-nvml")
    try:
        port = daemon.wait_started()
        url = f"https://127.0.0.1:{port}/metrics"
        context = ssl.create_default_context(cafile=str(TLS / "ca.crt"))
        context.load_cert_chain(str(TLS / "client.crt"), str(TLS / "client.key"))
        with urllib.request.urlopen(url, context=context, timeout=10) as reply:
            assert b"kvwatch_build_info" in reply.read()
        anonymous = ssl.create_default_context(cafile=str(TLS / "ca.crt"))
        with (
            pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)),
            urllib.request.urlopen(url, context=anonymous, timeout=10) as reply,
        ):
            reply.read()
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    finally:
        assert daemon.stop() == 0
