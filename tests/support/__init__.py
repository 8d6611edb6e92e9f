"""What both test folders share: real servers, the API emulator, a real Prometheus, the
real test model, and views of the repository's manifests and CRD."""

from pathlib import Path

# The repository: tests read its CRD, manifests and docs.
ROOT = Path(__file__).resolve().parents[2]
