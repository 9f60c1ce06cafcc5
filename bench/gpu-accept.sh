#!/usr/bin/env bash
# The GPU acceptance run (bench/gpu/accept.py): on a GPU host with .gpu/ carried
# (bench/gpu-carry.sh), from the repository root. Ceilings first (the compiled forward
# at the batch size, decode+resize), then every compile form compiled side by side, then
# the default command with each form on one card and on every card, from that cache. Prints the table; results and logs in $OUT (or
# .run/gpu-accept). Exit 0 when every row passes. Extra flags go to python -m bench.gpu
# (e.g. --accept-forms package to run the default form alone).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-.run/gpu-accept}
mkdir -p "$out"
exec bench/gpu-remote.sh python3 -m bench.gpu \
  --stages forward,decode,accept --compile --corpora 224x224 --forward-batches 256 \
  --kafka-bootstrap 127.0.0.1:9092 --redis-url redis://127.0.0.1:6379/0 \
  --pin --compile-cache .run/gpu-accept-cache --out "$out" "$@"
