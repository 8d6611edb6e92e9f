#!/usr/bin/env bash
# Installs NVIDIA Dynamo's planner (`ai-dynamo` and the `ai-dynamo-runtime` it requires)
# into its own virtualenv for bench/planners.py. Idempotent; everything lives under
# $BATCHPILOT_PEERS_CACHE (default ~/.cache/batchpilot-peers), never in the repository.
# Its pins (kubernetes<33 among them) conflict with ours, hence a venv of its own.
#
#   bench/peers/install_dynamo.sh
#
# `pip install ai-dynamo==1.6.1` fails here: it requires `aisimulate==0.13.0`, which on
# PyPI is a wheel stub that downloads the real wheel from pypi.nvidia.com at build time,
# and only the package registries are reachable (`wheel_stub.error.InstallFailedError: The
# installation of aisimulate for version 0.13.0 failed.`). So the two Dynamo wheels go in
# without their dependencies, then the dependencies they declare except `aisimulate` and
# `transformers` (the planner's core imports neither; `transformers` serves the engines),
# then what the planner imports without declaring it (numpy, scikit-learn, pandas, the
# load predictors' pmdarima/filterpy/prophet, prometheus-api-client, packaging, pyyaml:
# `aisimulate` brings them in a normal install). `aisimulate_core`, which the planner
# imports at module level, is replaced by the stand-in in bench/peers/dynamo_standin
# (its README says what it is); bench/planner_baselines.py puts it on the path.
#
# Output (what bench/planner_baselines.py runs): $CACHE/dynamo-venv/bin/python
set -euo pipefail

CACHE="${BATCHPILOT_PEERS_CACHE:-$HOME/.cache/batchpilot-peers}"
VERSION="${DYNAMO_VERSION:-1.6.1}"
VENV="$CACHE/dynamo-venv"
STAMP="$VENV/.installed-ai-dynamo-$VERSION"
STANDIN="$(cd "$(dirname "$0")" && pwd)/dynamo_standin"

if [ -f "$STAMP" ]; then
  echo "Dynamo: $VENV/bin/python (ai-dynamo $VERSION)"
  exit 0
fi
mkdir -p "$CACHE"
# run from the cache: the repository's `operator/` folder would shadow the standard
# library's `operator` module for any python started in the repository root
cd "$CACHE"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet)
"${pip[@]}" --upgrade pip
"${pip[@]}" --no-deps "ai-dynamo==$VERSION" "ai-dynamo-runtime==$VERSION"
# declared by ai-dynamo and ai-dynamo-runtime (less aisimulate and transformers), at the
# versions this script was written against
"${pip[@]}" \
  "aiohttp==3.14.5" "certifi==2026.10.19.post1" "kubernetes==32.0.1" "msgspec==0.23.0" \
  "prometheus-client==0.26.0" "pyzmq==27.3.0" "redis==8.2.0" "tqdm==4.70.1" \
  "typing-extensions==4.16.0" "zstandard==0.25.0" "pydantic==2.13.5" "uvloop==0.23.0"
# imported by the planner, undeclared
"${pip[@]}" \
  "numpy==2.4.6" "scikit-learn==1.9.1" "pandas==3.1.1" "pmdarima==2.1.1" "filterpy==2.0.0" \
  "prophet==1.5.0" "prometheus-api-client==0.7.2" "packaging==26.4" "pyyaml==6.0.4"
# the planner's tick engine, the module bench/planner_baselines.py drives
PYTHONPATH="$STANDIN" "$VENV/bin/python" -c \
  'import dynamo.planner.plugins.orchestrator.engine_adapter'
touch "$STAMP"
echo "Dynamo: $VENV/bin/python (ai-dynamo $VERSION)"
