"""The PD bed runs in build/vllm-pd-venv (tests/vllm_pd/setup_env.sh), never in .venv.

A stage timeout sends SIGTERM: turned into KeyboardInterrupt, so pytest still runs the fixture
teardown that stops every server's process group.
"""

import signal
from types import FrameType


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, _interrupt)
