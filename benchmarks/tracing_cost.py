"""What OpenTelemetry tracing costs the server: throughput at ``--concurrency`` streams with
``--otlp-traces-endpoint`` pointing at an OTLP/HTTP receiver on loopback (which accepts every
export), against the same server without it, a fresh server per run, alternating per round.
The ratio is traced ÷ untraced output tok/s per round, median over rounds.

    python benchmarks/tracing_cost.py --rounds 3 --output benchmarks/latest/tracing-cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cpu_limits import cpu_identity

from slotserve.bench.ab import alternate
from slotserve.bench.datasets import random_dataset
from slotserve.bench.loadgen import LoadConfig
from slotserve.bench.runner import run_benchmark
from slotserve.bench.servers import running, slotserve_spec
from slotserve.hosting.source import resolve_model_path


class _Receiver(BaseHTTPRequestHandler):
    exports = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).exports += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def one_run(endpoint: str | None, args: argparse.Namespace, logs: Path, seed: int) -> float:
    extra = ["--otlp-traces-endpoint", endpoint] if endpoint else []
    spec = slotserve_spec(resolve_model_path(None), args.concurrency, 0, 512, extra)
    with running(spec, logs) as server:
        dataset = random_dataset(args.requests, args.input_len, args.max_tokens, seed=seed)
        config = LoadConfig(base_url=server.api_url, concurrency=args.concurrency)
        report = run_benchmark(
            config, dataset, warmup=4, server_pid=server.pid, show_progress=False
        )
    if report["failed"]:
        raise RuntimeError(f"{report['failed']} requests failed")
    return float(report["output_throughput"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces"
    rounds = []
    with tempfile.TemporaryDirectory() as logs:
        for index in range(args.rounds):
            order = alternate(("traced", "untraced"), index)
            figures = {
                name: one_run(endpoint if name == "traced" else None, args, Path(logs), index)
                for name in order
            }
            figures["ratio"] = figures["traced"] / figures["untraced"]
            rounds.append(figures)
            print(f"round {index + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
    receiver.shutdown()
    result = {
        "cpu": cpu_identity(),
        "settings": vars(args) | {"output": str(args.output)},
        "exports_received": _Receiver.exports,
        "rounds": rounds,
        "ratio_median": statistics.median(r["ratio"] for r in rounds),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
