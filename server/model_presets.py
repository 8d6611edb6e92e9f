"""Names of the built-in model presets. Torch-free: the operator validates specs with it.

`batchpilot_server.models.PRESETS` holds the full specs; a test keeps the two in step.
"""

PRESET_NAMES: tuple[str, ...] = ("tiny",)
