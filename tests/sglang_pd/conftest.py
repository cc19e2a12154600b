"""The PD bed runs in build/sglang-venv inside a loopback-only netns (run.sh), never in .venv.

The main test run (``.venv``, no SGLang) does not collect these tests; inside the stage
(``KVWATCH_SGLANG_PD_STAGE=1``, set by run.sh) a missing SGLang is an error, never a skip.
A stage timeout sends SIGTERM: turned into KeyboardInterrupt, so pytest still runs the fixture
teardown that stops every server's process group.

The bed (``bed.running_bed``), one deployment per transport, serves test_pd.py and, over
Mooncake, test_pd_drain.py: pytest runs each transport's tests together, then stops its bed.
"""

import importlib.util
import os
import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest

collect_ignore = ["stubs"]

if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("smg") is None:
    if os.environ.get("KVWATCH_SGLANG_PD_STAGE") == "1":
        raise RuntimeError("sglang or smg is not importable: run tests/sglang_pd/setup_env.sh")
    collect_ignore_glob = ["test_*.py"]


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, _interrupt)


@pytest.fixture(scope="session")
def reference_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The plain server of test_pd.py's ``reference``, started (not waited for)."""
    from tests.sglang_pd.bed import reference_server, stop_all

    server = reference_server(tmp_path_factory.mktemp("single"))
    server.start()
    yield server
    stop_all([server])


@pytest.fixture(scope="session", params=["mooncake_tcp", "nixl"])
def bed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.sglang_pd.bed import running_bed  # needs requests: the stage's venv, not .venv

    # The reference server starts with the first bed's servers, where it takes its share of the
    # two cores (alone, its start left one idle for half a minute); only if a test needs it.
    if any("reference" in getattr(item, "fixturenames", ()) for item in request.session.items):
        request.getfixturevalue("reference_server")
    workdir = tmp_path_factory.mktemp(f"pd-{request.param}")
    with running_bed(request.param, workdir) as running:
        yield running
