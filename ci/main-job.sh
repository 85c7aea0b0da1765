#!/usr/bin/env bash
# The main job on a fresh machine, no GPU needed: install mxdb, audit every
# committed evidence bundle, load the shipped store export into a throwaway
# store and answer dispatches from it as the H200 host that measured it would.
set -euo pipefail
cd "$(dirname "$0")/.."

# mxdb from this checkout, in its own virtual environment (made on first use)
if [ ! -x .venv/bin/mxdb ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[model]"
fi
# shellcheck disable=SC1091
. .venv/bin/activate

echo "== mxdb audit evidence/"
mxdb audit evidence/

store="$(mktemp -d)/mxdb-demo.sqlite"
export MXDB_DB="sqlite:///$store"
echo "== mxdb import mxdb evidence/store-export.json  (into $store)"
mxdb import mxdb evidence/store-export.json

fp=evidence/h200-peers/fingerprint.json
for m in 4 64 1024; do
  echo "== mxdb dispatch Mixtral-8x7B bf16 M=$m (as recorded in $fp)"
  mxdb dispatch --experts 8 --hidden 4096 --intermediate 14336 --topk 2 --tokens "$m" \
    --dtype bf16 --routing-class uniform --fingerprint "$fp"
done
model=evidence/h200-perf-model-3/model.json
for m in 16 256; do
  echo "== mxdb dispatch E=64 H=3584 I=1280 k=8 M=$m (a family nothing measured) with the performance model"
  mxdb dispatch --experts 64 --hidden 3584 --intermediate 1280 --topk 8 --tokens "$m" \
    --dtype bf16 --routing-class uniform --fingerprint evidence/h200-perf-sweep/fingerprint.json \
    --perf-model "$model"
done
echo "== the same call on this machine's own fingerprint (no verified entry here: fallback)"
mxdb dispatch --experts 8 --hidden 4096 --intermediate 14336 --topk 2 --tokens 4 --dtype bf16
