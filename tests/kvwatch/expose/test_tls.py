"""/metrics over TLS with client-certificate auth (real HTTP, real handshake)."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.kvwatch.daemonproc import DaemonProcess

TLS = Path(__file__).parents[1] / "tls"


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


def test_a_tls_error_is_a_readable_line(tmp_path: Path) -> None:
    """A certificate that is not PEM: the log says so in words, not as a Python tuple
    (``("Cannot load ...",)``), and the failed start leaves no journal."""
    import json

    from tests.kvwatch.daemonproc import run_cli

    config = tmp_path / "kvwatch.toml"
    config.write_text(f'tls_cert_file = "{config}"\ntls_key_file = "{config}"\n')
    result = run_cli(
        "daemon",
        "--config",
        str(config),
        "--no-nvml",
        "--listen",
        "127.0.0.1:0",
        "--journal",
        str(tmp_path / "j.db"),
        "--spool-dir",
        str(tmp_path / "spool"),
    )
    assert result.returncode == 1
    (event,) = [e for e in map(json.loads, result.stderr.splitlines()) if e["level"] == "error"]
    assert event["event"] == "daemon.listen_failed"
    error = str(event["error"])
    assert error.startswith("Cannot load server certificate file"), error
    assert "PEM lib" in error and "_ssl.c" not in error and not error.endswith(",)"), error
    assert not (tmp_path / "j.db").exists()
