"""`recurrax serve` under load on this CPU: throughput and latency at 1, 8 and 64 concurrent clients.

    python benchmarks/serve.py                            # the committed run (a few minutes)
    python benchmarks/serve.py --quick --out /tmp/serve   # a smoke run
    source benchmarks/tpu_env.sh && python3 benchmarks/serve.py --uds --platform default   # a TPU VM (no TCP)

Writes `serve.md` and `serve.png` into `--out` (default `benchmarks/results/`); with
`--platform tpu` or `default`, `serve_<platform>.md` and `.png`. `--uds`: the server listens on a
unix socket and the clients reach it through httpx's unix-socket transport.

The model: a randomly initialised GLA of a few million parameters (`--hidden`, `--layers`)
with a character-level tokenizer (printable ASCII, one token per character, so each streamed
chunk is one token and inter-chunk gaps are inter-token latencies) and no end-of-sequence id
(every request generates exactly `--max-tokens` tokens). The server runs as users run it, a
`recurrax serve` subprocess on 127.0.0.1 with `--slots 64`, and is warmed by one round at
each concurrency first (prefill lengths compile once).

Each of `c` clients sends `--requests-per-client` streaming completions one after the other
(closed loop), prompts of 32 to 256 characters. Per request: time to first token (send →
first text chunk) and the gaps between its chunks; per level: output tokens per second of
wall time (all clients), and p50/p99 of both latencies. Clients and server share the
machine's cores (the clients are one asyncio process with `httpx`); the load average before
and after is recorded (the machine is shared with other work).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LEVELS = (1, 8, 64)


def write_checkpoint(directory: str, hidden: int, layers: int) -> int:
    """A random GLA model and a character-level tokenizer; returns the parameter count."""
    import jax
    from flax import nnx
    from tokenizers import Tokenizer, decoders, models

    jax.config.update("jax_platforms", "cpu")  # an accelerator is the server's: one process holds a TPU

    from recurrax.nn.pretrained import CausalLM, save_pretrained

    vocab = {chr(i): i - 32 for i in range(32, 127)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({}, f)
    config = dict(model_type="gla", vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers,
                  num_heads=4, hidden_ratio=4, use_short_conv=True, eos_token_id=None, bos_token_id=None,
                  pad_token_id=None)
    model = CausalLM(config, rngs=nnx.Rngs(0))
    save_pretrained(model, directory)
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def start_server(directory: str, slots: int, uds: str | None, platform_name: str) -> tuple[subprocess.Popen, str]:
    """`recurrax serve` in a process of its own, on TCP (any free port) or on the unix socket `uds`,
    its JAX on `platform_name` (`default`: JAX's own choice, the accelerator where there is one)."""
    listen = ["--uds", uds] if uds else ["--port", "0"]
    env = dict(os.environ) if platform_name == "default" else dict(os.environ, JAX_PLATFORMS=platform_name)
    process = subprocess.Popen([sys.executable, "-m", "recurrax.tools.cli", "serve", directory, *listen,
                                "--slots", str(slots), "--max-queue", "1024"], stderr=subprocess.PIPE, text=True,
                               env=env)
    said = []
    for line in process.stderr:
        if line.startswith("ready on "):
            threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()
            return process, line.split()[-1]
        said = [*said[-19:], line]
    raise RuntimeError(f"the server did not start (exit {process.wait()}); it said:\n{''.join(said)}")


def prompt(i: int) -> str:
    words = "the state of a recurrent model stays the same size however long the text grows".split()
    length = 32 + (i * 37) % 225
    return " ".join(words[(i + j) % len(words)] for j in range(length))[:length]


async def one_request(client, url: str, text: str, max_tokens: int) -> dict:
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    sent = time.perf_counter()
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter())
    return {"ttft": times[0] - sent, "gaps": [b - a for a, b in zip(times, times[1:])], "chunks": len(times)}


async def level(url: str, clients: int, requests_per_client: int, max_tokens: int) -> dict:
    """`url` is `http://HOST:PORT` or, as the server announces a unix socket, `unix:PATH`."""
    import httpx

    transport = httpx.AsyncHTTPTransport(uds=url[5:]) if url.startswith("unix:") else None
    url = "http://localhost" if transport else url
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 8),
                                 transport=transport) as client:

        async def one_client(c: int) -> list[dict]:
            return [await one_request(client, url, prompt(c * requests_per_client + r), max_tokens)
                    for r in range(requests_per_client)]

        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(one_client(c) for c in range(clients))) for r in rs]
        wall = time.perf_counter() - start
    ttft = sorted(r["ttft"] for r in results)
    gaps = sorted(g for r in results for g in r["gaps"])
    tokens = len(results) * max_tokens
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "chunks_per_request": statistics.mean(r["chunks"] for r in results),
            "ttft_p50_ms": 1e3 * quantile(ttft, 0.5), "ttft_p99_ms": 1e3 * quantile(ttft, 0.99),
            "itl_p50_ms": 1e3 * quantile(gaps, 0.5), "itl_p99_ms": 1e3 * quantile(gaps, 0.99)}


def quantile(sorted_values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of sorted values."""
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q * len(sorted_values) + 0.5) - 1))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny model, short requests (a smoke run)")
    parser.add_argument("--uds", action="store_true", help="serve on a unix socket (`recurrax serve --uds`), not TCP")
    parser.add_argument("--platform", default="cpu", help="the server's JAX platform (`default`: JAX's choice, e.g. "
                        "a TPU); results go to serve.md on cpu, serve_<platform>.md otherwise")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.max_tokens, args.requests_per_client = 64, 1, 8, 1
    with tempfile.TemporaryDirectory() as directory:
        params = write_checkpoint(directory, args.hidden, args.layers)
        socket_path = os.path.join(directory, "serve.sock") if args.uds else None
        process, url = start_server(directory, max(LEVELS), socket_path, args.platform)
        try:
            for clients in LEVELS:  # warm-up: every prefill length the levels use compiles here
                asyncio.run(level(url, clients, 1, 2))
            load_before = os.getloadavg()
            rows = [asyncio.run(level(url, c, args.requests_per_client, args.max_tokens)) for c in LEVELS]
            load_after = os.getloadavg()
        finally:
            process.terminate()
            process.wait(120)
    run = {"params": params, "listen": "a unix socket" if args.uds else "TCP on 127.0.0.1",
           "device": device_kind(args.platform), "hidden": args.hidden, "layers": args.layers, "max_tokens": args.max_tokens,
           "requests_per_client": args.requests_per_client, "rows": rows, "load_before": load_before,
           "load_after": load_after, "machine": f"{platform.processor() or platform.machine()}, "
                                                f"{os.cpu_count()} cores, Python {platform.python_version()}"}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "serve" if args.platform == "cpu" else f"serve_{args.platform}"
    write_markdown(args.out / f"{name}.md", run)
    plot(args.out / f"{name}.png", run)
    print((args.out / f"{name}.md").read_text())
    return 0


def device_kind(platform_name: str) -> str:
    """What the server computes on: JAX's first device on that platform, asked in a process of its own
    (the server's process holds an accelerator while it runs)."""
    env = dict(os.environ) if platform_name == "default" else dict(os.environ, JAX_PLATFORMS=platform_name)
    return subprocess.run([sys.executable, "-c", "import jax; print(jax.devices()[0].device_kind)"], env=env,
                          capture_output=True, text=True, check=True).stdout.strip()


def write_markdown(path: Path, run: dict) -> None:
    lines = [
        f"# `recurrax serve` under load ({run['device']}, {run['listen']})",
        "",
        f"GLA, {run['params'] / 1e6:.1f} M parameters (hidden {run['hidden']}, {run['layers']} layers, 4 heads), "
        f"character-level tokenizer; `recurrax serve --slots 64`; each client sends {run['requests_per_client']} "
        f"streaming completions in turn (greedy, {run['max_tokens']} new tokens, prompts of 32–256 characters). "
        f"Produced by `python benchmarks/serve.py` on {run['machine']}; the server computes on {run['device']} "
        f"and listens on {run['listen']}.",
        "",
        f"**Shared machine:** load average {run['load_before'][0]:.1f} before, {run['load_after'][0]:.1f} after "
        "(other work ran beside it; the clients share the cores with the server).",
        "",
        "| clients | requests | tokens | wall s | tokens/s | TTFT p50 ms | TTFT p99 ms | inter-token p50 ms | "
        "inter-token p99 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in run["rows"]:
        lines.append(f"| {r['clients']} | {r['requests']} | {r['tokens']} | {r['wall_s']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                     f"{r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} |")
    lines += ["", "TTFT: from sending the request to its first text chunk (waiting for a slot, the prefill, "
              "the first token). Inter-token: the gaps between a request's chunks (one token each). "
              "All 64 clients fit the 64 slots: nobody waits in the queue; new requests join between decode "
              "steps, so a prefill delays the running streams' next token (the p99 gaps)."]
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, run: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = run["rows"]
    clients = [r["clients"] for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(clients, [r["tokens_per_s"] for r in rows], "o-")
    left.set(xscale="log", xticks=clients, xticklabels=clients, xlabel="concurrent clients",
             ylabel="output tokens / s", title="throughput")
    for key, label in [("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("itl_p50_ms", "inter-token p50"),
                       ("itl_p99_ms", "inter-token p99")]:
        right.plot(clients, [r[key] for r in rows], "o-", label=label)
    right.set(xscale="log", yscale="log", xticks=clients, xticklabels=clients, xlabel="concurrent clients",
              ylabel="ms", title="latency")
    right.legend()
    figure.suptitle(f"recurrax serve, GLA {run['params'] / 1e6:.1f} M params, {run['device']} "
                    f"(load {run['load_before'][0]:.1f}→{run['load_after'][0]:.1f})")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
