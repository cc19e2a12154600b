"""The PD bed runs in build/sglang-venv inside a loopback-only netns (run.sh), never in .venv.

The main test run (``.venv``, no SGLang) does not collect these tests; inside the stage
(``KVWATCH_SGLANG_PD_STAGE=1``, set by run.sh) a missing SGLang is an error, never a skip.
A stage timeout sends SIGTERM: turned into KeyboardInterrupt, so pytest still runs the fixture
teardown that stops every server's process group.
"""

import importlib.util
import os
import signal
from types import FrameType

collect_ignore = ["stubs"]

if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("smg") is None:
    if os.environ.get("KVWATCH_SGLANG_PD_STAGE") == "1":
        raise RuntimeError("sglang or smg is not importable: run tests/sglang_pd/setup_env.sh")
    collect_ignore_glob = ["test_*.py"]


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, _interrupt)
