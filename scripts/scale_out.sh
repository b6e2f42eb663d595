#!/usr/bin/env bash
# Start N kvsplice replicas and sglang-router (cache_aware) on this machine; Ctrl-C stops them all.
#   scripts/scale_out.sh MODEL [REPLICAS] [ROUTER_PORT] [-- extra `kvsplice serve` flags]
#   e.g. scripts/scale_out.sh ~/models/SmolLM2-135M-Instruct 3 30000 -- --num-slots 65536
# Then point any OpenAI client at http://127.0.0.1:ROUTER_PORT/v1. Logs: ./scale_out_logs/.
# Needs: pip install sglang-router==0.3.2. Policy / health endpoint: edit below or run
#   python -m kvsplice.bench.scale_out --help
set -euo pipefail
if [[ $# -lt 1 ]]; then
  sed -n '2,7p' "$0" >&2
  exit 2
fi
model=$1; shift
replicas=3; port=30000
if [[ $# -gt 0 && $1 != "--" ]]; then replicas=$1; shift; fi
if [[ $# -gt 0 && $1 != "--" ]]; then port=$1; shift; fi
exec python -m kvsplice.bench.scale_out --model "$model" --replicas "$replicas" --port "$port" \
  --policy "${POLICY:-cache_aware}" --health-check-endpoint "${HEALTH_ENDPOINT:-/readiness}" "$@"
