"""The README's "Put it on a node" steps, run as written from the built wheel.

Each ``sh`` line of that section is run after three mechanical rewrites: ``sudo`` is dropped,
absolute paths move under a temporary root, and Grafana's URL points at a local HTTP server.
Three lines cannot run on a test machine as written; ``SUBSTITUTES`` says what is checked
instead. A line the README gains without a way to run it here fails the test.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.dashboards.test_dashboards_push import TOKEN, FakeGrafana
from tests.install.conftest import BUILD, REPO, run, wheel

SECTION = "## Put it on a node"
GRAFANA = "https://grafana.example.com:3000"


def readme_lines() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_the_section_has_every_step() -> None:
    text = " ".join(readme_lines())
    for needed in (
        "make dist", "[engine]", "SGLANG_PLUGINS=kvwatch", "systemctl enable", "kvwatch status",
        "promtool check config", "amtool check-config", "dashboards push",
    ):  # fmt: skip
        assert needed in text, needed


class Node:
    """A temporary root standing in for ``/`` on a serving node."""

    def __init__(self, root: Path, dist: Path, engine: Path, grafana: FakeGrafana) -> None:
        self.root = root
        self.dist = dist
        self.engine = engine
        self.grafana = grafana
        self.port = free_port()
        self.daemon: subprocess.Popen[bytes] | None = None

    def rewrite(self, line: str) -> str:
        line = re.sub(r"^sudo ", "", line).replace(" && sudo ", " && ")
        # One pass, so that the root's own path is not rewritten again.
        line = re.sub(r"(?<![\w.])/(opt|etc|tmp|run|var)/", rf"{self.root}/\1/", line)
        line = re.sub(r"(?<![\w./])dist/", f"{self.dist}/", line)
        line = line.replace(GRAFANA, self.grafana.url)
        if line.startswith("pip install"):
            line = f"{self.engine}/{line}"  # "into the engine's environment"
        return line

    def sh(self, line: str) -> subprocess.CompletedProcess[str]:
        return run(["bash", "-euo", "pipefail", "-c", line], cwd=self.root)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _make_dist(node: Node, _line: str) -> None:
    """Not run here (it would rebuild the checkout's .venv): the ``dist`` fixture ran the same
    build the Makefile's dist target runs, and both files are there."""
    recipe = (REPO / "Makefile").read_text().split("\ndist:", 1)[1].split("\n\n", 1)[0]
    assert f"$(PY) {' '.join(BUILD)} dist ." in recipe
    assert wheel(node.dist).is_file() and list(node.dist.glob("kvwatch-*.tar.gz"))


def _useradd(node: Node, line: str) -> None:
    """Not run here (it would add a user to the test machine): the user it creates is the one
    the unit runs as and the one the image creates."""
    user = line.rsplit(maxsplit=1)[-1]
    unit = (REPO / "deploy" / "kvwatch.service").read_text()
    assert f"\nUser={user}\n" in unit and f"\nGroup={user}\n" in unit
    assert "--home-dir /var/lib/kvwatch" in line and "StateDirectory=kvwatch" in unit
    assert (
        "useradd --system --uid 65532 --gid 65532 --home-dir /var/lib/kvwatch"
        in ((REPO / "Containerfile").read_text())
        and user == "kvwatch"
    )


def _systemctl(node: Node, _line: str) -> None:
    """Not run here (no systemd as PID 1): the installed unit passes ``systemd-analyze verify``
    with its paths under the root, and its ExecStart, run as written with the installed config
    (paths and port moved), starts a daemon that gets ready."""
    unit = node.root / "etc/systemd/system/kvwatch.service"
    exec_start = next(x for x in unit.read_text().splitlines() if x.startswith("ExecStart="))
    argv = shlex.split(node.rewrite(exec_start.removeprefix("ExecStart=")))
    assert argv[0] == f"{node.root}/opt/kvwatch/bin/kvwatch"
    moved = unit.with_name("kvwatch-verify.service")
    moved.write_text(unit.read_text().replace(exec_start, "ExecStart=" + shlex.join(argv)))
    verify = run(["systemd-analyze", "verify", str(moved)], cwd=node.root, check=False)
    assert verify.returncode == 0, verify.stderr
    config = node.root / "etc/kvwatch/kvwatch.toml"
    text = config.read_text()
    for key in ("spool_dir", "journal"):
        text = re.sub(rf'^{key} = "/', f'{key} = "{node.root}/', text, flags=re.M)
    text = re.sub(r'^listen = ".*"', f'listen = "127.0.0.1:{node.port}"', text, flags=re.M)
    text = re.sub(r"^nvml = true", "nvml = false", text, flags=re.M)  # no GPU on CI
    config.write_text(text)
    (node.root / "run/kvwatch/spool").mkdir(parents=True)  # systemd's RuntimeDirectory=
    log = (node.root / "daemon.log").open("w")
    node.daemon = subprocess.Popen(argv, cwd=node.root, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{node.port}/-/ready", timeout=2):
                break
        except OSError:
            assert node.daemon.poll() is None, (node.root / "daemon.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)


def _status(node: Node, line: str) -> None:
    """Run as written, with the daemon's address (the port moved off 29321)."""
    result = run(
        [*shlex.split(node.rewrite(line)), "--url", f"http://127.0.0.1:{node.port}"],
        cwd=node.root,
        check=False,
    )
    # No engine writes yet: a warning (3) that says so, never a traceback.
    assert result.returncode == 3, result.stderr
    assert result.stdout.startswith("WARNING: no live producer")


SUBSTITUTES: dict[str, Callable[[Node, str], None]] = {
    "make dist": _make_dist,
    "sudo useradd ": _useradd,
    "sudo systemctl ": _systemctl,
    "/opt/kvwatch/bin/kvwatch status": _status,
}


def test_put_it_on_a_node(tmp_path: Path, dist: Path, engine: Path, grafana: FakeGrafana) -> None:
    node = Node(tmp_path / "node", dist, engine, grafana)
    node.root.mkdir()
    (node.root / "etc/kvwatch").mkdir(parents=True)
    (node.root / "etc/kvwatch/grafana-token").write_text(TOKEN)
    ran: list[str] = []
    try:
        for line in readme_lines():
            special = next((f for p, f in SUBSTITUTES.items() if line.startswith(p)), None)
            if special is not None:
                special(node, line)
            elif line.startswith("export SGLANG_PLUGINS="):
                # As SGLang does: the entry points of sglang.srt.plugins named in SGLANG_PLUGINS.
                code = (
                    "import os; from importlib.metadata import entry_points\n"
                    "names = os.environ['SGLANG_PLUGINS'].split(',')\n"
                    "group = entry_points(group='sglang.srt.plugins')\n"
                    "eps = [e for e in group if e.name in names]\n"
                    "print([e.load().__module__ for e in eps], os.environ['KVWATCH_SPOOL'])\n"
                )
                out = node.sh(f"{node.rewrite(line)}; {node.engine}/python -c {shlex.quote(code)}")
                assert out.stdout.split()[0] == "['engine_hooks.sglang']"
            else:
                node.sh(node.rewrite(line))
            ran.append(line)
        # What the steps left behind, checked.
        assert (node.root / "opt/kvwatch/bin/kvwatch").is_file()
        assert not list((node.root / "opt/kvwatch/lib").glob("python3*/site-packages/torch"))
        rules = node.root / "etc/prometheus/kvwatch"
        assert (rules / "kvwatch.rules.yml").read_bytes() == (
            REPO / "alerts/kvwatch.rules.yml"
        ).read_bytes()
        assert [p for _, p, _, _ in grafana.requests if p == "/api/dashboards/db"]
        summary = json.loads(
            urllib.request.urlopen(
                urllib.request.Request(
                    f"http://127.0.0.1:{node.port}/", headers={"Accept": "application/json"}
                ),
                timeout=10,
            ).read()
        )
        assert summary["level"] == "warning"
    finally:
        if node.daemon is not None:
            node.daemon.terminate()
            assert node.daemon.wait(30) == 0
    assert ran == readme_lines()


def test_the_image_and_daemonset_match_the_wheel() -> None:
    """The DaemonSet runs what the Containerfile installs, as the user it creates, with the
    daemon's real paths; its probes and port are the daemon's."""
    from kvwatch import __version__
    from kvwatch.config import DEFAULT_JOURNAL, DEFAULT_PORT, DEFAULT_SPOOL_DIR

    containerfile = (REPO / "Containerfile").read_text()
    manifest = (REPO / "deploy/kubernetes.yaml").read_text()
    assert 'ENTRYPOINT ["/opt/kvwatch/bin/kvwatch"]' in containerfile
    assert "COPY dist/kvwatch-*.whl" in containerfile
    assert "USER 65532:65532" in containerfile and f"EXPOSE {DEFAULT_PORT}" in containerfile
    assert f"image: ghcr.io/kvwatch/kvwatch:{__version__}" in manifest
    assert 'command: ["/opt/kvwatch/bin/kvwatch"]' in manifest
    assert "runAsUser: 65532" in manifest and "runAsGroup: 65532" in manifest
    assert (
        f"containerPort: {DEFAULT_PORT}" in manifest and f'listen = ":{DEFAULT_PORT}"' in manifest
    )
    assert "path: /-/ready" in manifest and "path: /-/healthy" in manifest
    assert f"mountPath: {DEFAULT_SPOOL_DIR}" in manifest
    assert f"mountPath: {Path(DEFAULT_JOURNAL).parent!s}" in manifest
    assert "capabilities: {drop: [ALL]}" in manifest
    # One node name: the daemon's --node is the node the ServiceMonitor names the target by.
    assert '"--node", "$(NODE_NAME)"]' in manifest
    assert "valueFrom: {fieldRef: {fieldPath: spec.nodeName}}" in manifest
    assert "{sourceLabels: [__meta_kubernetes_pod_node_name], targetLabel: node}" in manifest
    unit = (REPO / "deploy/kvwatch.service").read_text()
    assert "ExecStart=/opt/kvwatch/bin/kvwatch daemon --config /etc/kvwatch/kvwatch.toml" in unit
    assert "CapabilityBoundingSet=\n" in unit
