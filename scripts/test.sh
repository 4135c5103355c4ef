#!/usr/bin/env bash
# The test suite: set-up (idempotent), then pytest; prints the suite's wall time at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
start=$(date +%s)
status=0
python3 -m pytest -q -p no:cacheprovider "$@" || status=$?
echo "test suite wall time: $(( $(date +%s) - start )) s on $(nproc) cores"
exit $status
