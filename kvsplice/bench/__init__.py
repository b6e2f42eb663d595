"""Benchmarks for agent workloads, client side (works against any OpenAI-compatible server).

- `trace`: the JSONL trace format (one conversation per line, full messages per turn, edit kinds).
- `workload`: synthetic context-editing agent conversations from standard-library docstrings.
- `replay`: replays a trace with streaming requests and records usage, TTFT and errors per request.
- `report`: token shares by compute type, prefilled breakdown, FLOPs, TTFT, self-checks and plots.
- `commands`: the `kvsplice bench | report | workload` argparse front ends.
"""
