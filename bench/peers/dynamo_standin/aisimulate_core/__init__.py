"""A stand-in for AISimulate's `aisimulate_core` (see ../README.md); not NVIDIA's code."""
