"""The engine: models and weights, the paged KV cache and attention, schedulers, the step
loop (core.py), sampling and the grammar state it masks with. It imports nothing of the
HTTP side (batchpilot_server.http)."""
