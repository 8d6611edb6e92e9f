"""Names of the built-in model presets and how a model reference is named. Torch-free:
the operator validates specs with it.

`batchpilot_server.engine.models.PRESETS` holds the full specs; a test keeps the two in step.
"""

from pathlib import PurePath

PRESET_NAMES: tuple[str, ...] = ("tiny",)


def default_served_name(model: str) -> str:
    """The name a model is served as unless told otherwise: the preset's name, a
    model directory's basename, a GGUF file's stem."""
    if model in PRESET_NAMES:
        return model
    path = PurePath(model)
    return path.stem if path.suffix == ".gguf" else path.name
