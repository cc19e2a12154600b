"""The vLLM stage runs in build/vllm-venv (tests/vllm/setup_env.sh), never in .venv.

No skip here: without vLLM this stage fails at import, loudly.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
