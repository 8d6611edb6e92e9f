"""batchpilot Kubernetes operator. Never imports torch."""
