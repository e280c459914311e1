"""Time from `strata serve` to the first answered request: when the port answers, when /health says 200, then ten
short chat requests one after another (40 prompt tokens, 26 of them the template's system prompt, 7 generated).

    .venv/bin/python scripts/bench_first_request.py [--model qwen2.5-coder-0.5b] [--port 8123]

Prints one line: port, health 200, and each request's seconds. The model must already be pulled (and warmed by
the pull: see docs/OPERATIONS.md, "Start-up"); docs/BENCHMARKS.md, "First request after start", has the runs.
"""
import argparse
import subprocess
import time

import httpx


def wait_ready(client: httpx.Client, port: int, started: float) -> tuple[float, float]:
    """Seconds until the port answered and until /health said 200."""
    answered = None
    while True:
        try:
            status = client.get(f"http://127.0.0.1:{port}/health").status_code
            answered = answered or time.time() - started
            if status == 200:
                return answered, time.time() - started
        except httpx.TransportError:
            pass
        time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--port", type=int, default=8123)
    args = ap.parse_args()
    started = time.time()
    server = subprocess.Popen([".venv/bin/strata", "serve", "--model", args.model, "--port", str(args.port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(timeout=600) as client:
            answered, ready = wait_ready(client, args.port, started)
            seconds, answer = [], ""
            for i in range(1, 11):
                sent = time.time()
                reply = client.post(f"http://127.0.0.1:{args.port}/v1/chat/completions", json={
                    "model": args.model, "max_tokens": 16, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Question {i}: what is the capital of France?"}]})
                seconds.append(time.time() - sent)
                answer = reply.json()["choices"][0]["message"]["content"]
    finally:
        server.terminate()
        server.wait()
    print(f"port answers {answered:.1f} s, /health 200 {ready:.1f} s, requests (s):",
          " ".join(f"{t:.2f}" for t in seconds), f"| last answer {answer!r}")


if __name__ == "__main__":
    main()
