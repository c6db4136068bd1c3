import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))  # tiny_models


@pytest.fixture(scope="session")
def smollm2_path():
    from inferscale_core.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """SmolLM2-135M-Instruct in fp32 on the CPU: (model, tokenizer)."""
    from inferscale_core.models import load_model

    return load_model(smollm2_path)
