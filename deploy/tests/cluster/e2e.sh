#!/bin/bash
# The cluster end-to-end test, from scratch or cached: builds the one-node Kubernetes (build.sh, cached under
# ~/.cache/kube-test), the images (`cargo xtask images`, release binaries unless KINFERENCE_E2E_IMAGES says), the Python test clients
# (`cargo xtask setup`), then runs deploy/tests/cluster/cluster_e2e.py, which starts the cluster, installs the
# charts, runs the workload and stops the cluster (KINFERENCE_KEEP_CLUSTER=1 leaves it running for a look).
# Needs root. Usage: deploy/tests/cluster/e2e.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/../../.."
t0=$(date +%s)
bash deploy/tests/cluster/build.sh > /tmp/kinference-cluster-build.log 2>&1 || { tail -20 /tmp/kinference-cluster-build.log; exit 1; }
echo "[e2e] cluster binaries ready after $(( $(date +%s) - t0 )) s"
cargo xtask setup >/dev/null
# KINFERENCE_E2E_IMAGES=debug packages the debug binaries `cargo xtask test` already built (CI: no release
# build); =skip keeps target/images as it is; anything else builds release images.
case "${KINFERENCE_E2E_IMAGES:-release}" in
  debug) cargo xtask images --debug --no-build ;;
  skip) ;;
  *) cargo xtask images ;;
esac
echo "[e2e] images ready after $(( $(date +%s) - t0 )) s"
KINFERENCE_TEST_CLUSTER=1 .venv/bin/python -m pytest -q -s -p no:cacheprovider deploy/tests/cluster/cluster_e2e.py "$@"
echo "[e2e] done after $(( $(date +%s) - t0 )) s"
