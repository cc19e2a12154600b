"""The vLLM stage runs in build/vllm-venv (tests/vllm/setup_env.sh), never in .venv.

No skip here: without vLLM this stage fails at import, loudly.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from harness import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny-llama"))
