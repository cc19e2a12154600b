"""The probe's sizing logic and its handling of servers that answer badly."""

from __future__ import annotations

import argparse
import http.server
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import pytest

from kvwatch.commands import probe


def test_fit_recovers_a_linear_tokenizer() -> None:
    sizing = probe.fit([(16, 2 * 16 + 7), (64, 2 * 64 + 7), (256, 2 * 256 + 7)])
    assert sizing.per_word == pytest.approx(2)
    assert sizing.fixed == pytest.approx(7)
    assert sizing.words_for(1007) == 500


def test_fit_rejects_useless_calibration() -> None:
    with pytest.raises(probe.ProbeError):
        probe.fit([(16, 20), (16, 20)])
    with pytest.raises(probe.ProbeError):
        probe.fit([(16, 20), (64, 20)])


def test_aim_is_inside_the_band() -> None:
    target = probe.aim(681_280, 1_048_576)
    assert 681_280 < target <= 1_048_576
    with pytest.raises(probe.ProbeError, match="no unsafe band"):
        probe.aim(2_040_000, 1_048_576)


@pytest.mark.parametrize(
    ("url", "loopback"),
    [
        ("http://127.0.0.1:8000", True),
        ("http://localhost:8000/generate", True),
        ("http://[::1]:8000", True),
        ("http://127.8.9.10", True),
        ("http://10.0.0.1:8000", False),
        ("https://api.example.com", False),
    ],
)
def test_loopback_detection(url: str, loopback: bool) -> None:
    assert probe.is_loopback(url) is loopback


class Handler(http.server.BaseHTTPRequestHandler):
    behaviour = "ok"
    sent: ClassVar[list[int]] = []  # the prompt tokens of each request answered "ok"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        body = json.loads(self.rfile.read(length))
        kind = type(self).behaviour
        if kind == "slow":
            time.sleep(2)
        if kind == "html":
            self._send(200, b"<html>gateway</html>")
        elif kind == "no-meta":
            self._send(200, json.dumps({"text": "hi"}).encode())
        elif kind == "list":
            self._send(200, b"[1, 2]")
        elif kind == "ok":
            words = body["text"].count("word ")
            type(self).sent.append(words + 6)
            meta = {"prompt_tokens": words + 6, "completion_tokens": 1, "finish_reason": "length"}
            self._send(200, json.dumps({"text": "x", "meta_info": meta}).encode())

    def _send(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@contextmanager
def server(behaviour: str, sent: list[int] | None = None) -> Iterator[str]:
    handler = type("H", (Handler,), {"behaviour": behaviour, "sent": [] if sent is None else sent})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def args(url: str, **extra: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    probe.add_parser(parser.add_subparsers())
    argv = [
        "probe",
        "--url",
        url,
        "--prompt-tokens",
        "100",
        "--markers",
        "1",
        "--marker-repeats",
        "1",
        "--timeout",
        "0.5",
    ]
    for key, value in extra.items():
        argv.append("--" + key.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("behaviour", "message"),
    [
        ("slow", "no answer within"),
        ("html", "is not JSON"),
        ("no-meta", "lacks 'text' or 'meta_info'"),
        ("list", "expected a JSON object"),
    ],
)
def test_bad_responses_give_a_message_and_an_exit_code(
    behaviour: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with server(behaviour) as url:
        code = probe.run(args(url))
    assert code == probe.EXIT_FAILED
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    with server("ok") as url:
        pass  # closed again: nothing listens there now
    assert probe.run(args(url)) == probe.EXIT_FAILED
    assert "cannot reach" in capsys.readouterr().err


def test_refuses_a_remote_url_without_ownership(capsys: pytest.CaptureFixture[str]) -> None:
    assert probe.run(args("http://192.0.2.1:8000")) == probe.EXIT_USAGE
    assert "not on loopback" in capsys.readouterr().err


def test_json_output_of_an_answered_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    with server("ok") as url:
        code = probe.run(args(url, json=True))
    out = json.loads(capsys.readouterr().out)
    assert code == probe.EXIT_ANSWERED
    assert out["status"] == 200
    assert out["prompt_tokens"] == 100  # sized from calibration: words + 6 tokens
    assert out["exit_code"] == probe.EXIT_ANSWERED
    assert "word word" not in json.dumps(out)  # the filler is never printed


def test_with_the_pool_known_no_sizing_prompt_goes_past_it() -> None:
    """Only the long prompt may be past the pool: the calibration's 1,024-word prompt (1,030
    tokens here) would itself be rejected at intake, and leak on a vulnerable release, in a
    pool of 1,024 tokens. The markers are the user's to size (one repeat here)."""
    sent: list[int] = []
    with server("ok", sent) as url:
        code = probe.run(args(url, pool_tokens=1024, context_length=2048, prompt_tokens=1536))
    assert code == probe.EXIT_ANSWERED
    long, *sizing = sorted(sent, reverse=True)
    assert long == 1536  # sized from the calibration's fit: words + 6 tokens
    assert max(sizing) <= 1024 * probe.IN_POOL, sent
    assert 256 + 6 in sizing  # calibrated all the same, from what fits
