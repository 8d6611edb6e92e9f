"""batchpilot inference server: model, KV cache, schedulers, engine, HTTP app."""
