#!/usr/bin/env bash
# `make e2e-kind`: the whole operator on a throwaway kind cluster.
#   1. create a kind cluster (reused if it exists), 2. build the image and load it,
#   3. apply manifests/ (CRD, RBAC, operator) and wait for the operator,
#   4. run tests/e2e/test_kind.py: apply a policy, wait for its pods, drive load
#      through `kubectl port-forward`, wait for a tuning decision in its status,
#      delete it and check that everything it owned is gone.
# Needs docker, kind and kubectl. KEEP_CLUSTER=1 keeps the cluster afterwards.
# Not run in this repository's CI (no Docker engine there).
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER="${BATCHPILOT_KIND_CLUSTER:-batchpilot-e2e}"
IMAGE="${BATCHPILOT_IMAGE:-batchpilot:0.1.0}"
PYTHON="${PYTHON:-.venv/bin/python}"

for tool in docker kind kubectl; do
  command -v "$tool" >/dev/null 2>&1 || { echo "e2e-kind: '$tool' is not installed" >&2; exit 1; }
done

KUBECONFIG_FILE="$(mktemp)"
cleanup() {
  rm -f "$KUBECONFIG_FILE"
  if [ "${KEEP_CLUSTER:-0}" != 1 ]; then kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

if ! kind get clusters | grep -qx "$CLUSTER"; then
  kind create cluster --name "$CLUSTER" --wait 180s
fi
kind get kubeconfig --name "$CLUSTER" >"$KUBECONFIG_FILE"
export KUBECONFIG="$KUBECONFIG_FILE"

docker build -t "$IMAGE" .
kind load docker-image "$IMAGE" --name "$CLUSTER"

kubectl apply -k manifests/
kubectl wait --for condition=established --timeout=60s crd/batchingpolicies.batchpilot.io
kubectl -n batchpilot-system rollout status deployment/batchpilot-operator --timeout=180s

BATCHPILOT_E2E_KUBECONFIG="$KUBECONFIG_FILE" BATCHPILOT_IMAGE="$IMAGE" \
  "$PYTHON" -m pytest -m e2e_kind tests/e2e/test_kind.py -v -p no:cacheprovider
