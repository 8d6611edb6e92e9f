"""What a request that names no sampling value gets, from the model's own files.

As vLLM: the values of a model directory's `generation_config.json` (temperature,
top_p, top_k, min_p, repetition_penalty), or of a GGUF file's `general.sampling.*`
metadata (llama.cpp's names); else what changes nothing, at temperature 1.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

log = logging.getLogger("batchpilot.server")


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0


# a model that says nothing
MODEL_NEUTRAL = GenerationDefaults()

# llama.cpp's GGUF keys (llama-model.cpp, LLM_KV_GENERAL_SAMPLING_*) -> ours
GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def generation_defaults(model: str) -> GenerationDefaults:
    """The defaults of `model` (a preset name, a model directory or a .gguf file)."""
    path = Path(model)
    if path.is_dir():
        values = _generation_config(path / "generation_config.json")
    elif path.is_file() and path.suffix == ".gguf":
        values = _gguf_sampling(path)
    else:
        values = {}  # a preset: no generation config
    defaults = _from_values(values)
    if values:
        log.info("sampling defaults from the model's files: %s", defaults)
    return defaults


def _generation_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # none, or unreadable: the weights loader reports a broken directory
    names = {f.name for f in fields(GenerationDefaults)}
    return (
        {key: value for key, value in config.items() if key in names}
        if isinstance(config, dict)
        else {}
    )


def _gguf_sampling(path: Path) -> dict[str, Any]:
    from gguf import GGUFReader  # numpy: only for GGUF files

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError):
        return {}
    values = {}
    for key, name in GGUF_KEYS.items():
        field = reader.fields.get(key)
        if field is not None and field.data:
            values[name] = field.parts[field.data[0]][0].item()
    return values


def _from_values(values: dict[str, Any]) -> GenerationDefaults:
    """Only values in the API's ranges: a file's odd value is no request's fault."""
    checks = {
        "temperature": lambda v: 0.0 <= v <= 2.0,
        "top_p": lambda v: 0.0 < v <= 1.0,
        "top_k": lambda v: v >= -1,
        "min_p": lambda v: 0.0 <= v <= 1.0,
        "repetition_penalty": lambda v: 0.0 < v <= 10.0,
    }
    defaults = GenerationDefaults()
    for name, value in values.items():
        if isinstance(value, int | float) and not isinstance(value, bool) and checks[name](value):
            value = max(int(value), 0) if name == "top_k" else float(value)  # top_k -1: all
            defaults = replace(defaults, **{name: value})
        else:
            log.warning("ignoring the model's default %s=%r: out of the API's range", name, value)
    return defaults
