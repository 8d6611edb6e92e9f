"""Soak: minutes of mixed load against a real `batchpilot serve` with a KV-tight pool.

Closed-loop clients send non-streamed and streamed completions; some streams
are dropped by the client mid-way; an admin client PUTs new batching knobs
every couple of seconds. Reports requests sent / ok / rejected (an answered
429/503, or a 400 that names the KV pool) / lost (anything else: a 5xx, a
broken connection, a stream without [DONE]), the server's RSS and open file
descriptors after warm-up and at the end, and KV blocks still held once the
load ends (from /metrics). Targets: 0 lost, 0 leaked, RSS growth < 10 %.

    python bench/soak.py                 # ~3 minutes
    python bench/soak.py --duration-s 120
    python bench/soak.py --quick         # ~20 s, for a smoke run

Prints a table and a final JSON line; writes its section of docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from batchpilot_server import metric_names as names
from batchpilot_tools.demo.supervisor import stop_process
from batchpilot_tools.prometheus_local import free_port
from prometheus_client.parser import text_string_to_metric_families
from sections import replace_section

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"
TOKEN = "soak-token"
RSS_GROWTH_TARGET = 0.10
REJECTED = (429, 503)
INTRO = (
    "Closed-loop clients against a real `batchpilot serve` (tiny model, KV pool of a few MB): "
    "non-streamed and streamed completions, a quarter of them dropped by the client "
    "mid-stream, an admin PUT of new knobs every 2 s. Lost = a 5xx, a broken connection "
    "or a stream without `[DONE]`; KV usage read from `/metrics` after the load. "
    "`python bench/soak.py` (~3 min; `--duration-s`, `--quick`)."
)


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    rejected: int = 0
    disconnected: int = 0  # streams this client dropped on purpose
    lost: int = 0
    admin_puts: int = 0
    lost_examples: list[str] = field(default_factory=list)

    def lose(self, why: str) -> None:
        self.lost += 1
        if len(self.lost_examples) < 5:
            self.lost_examples.append(why)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=180.0)
    p.add_argument("--quick", action="store_true", help="20 s: a smoke run")
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--kv-cache-mb", type=float, default=3.0, help="small: preemption happens")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-doc", action="store_true", help="do not write docs/reliability.md")
    args = p.parse_args(argv)
    if args.quick:
        args.duration_s = 20.0
    return args


# -- the server process ---------------------------------------------------------------------


def start_server(args: argparse.Namespace, token_file: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "batchpilot_server.cli", "serve", "--model", "tiny",
        "--port", str(port), "--device", "cpu", "--threads", str(args.threads),
        "--kv-cache-mb", str(args.kv_cache_mb), "--max-batch-size", "8",
        "--max-queue-size", "32", "--admin-token-file", str(token_file),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2):
                return proc, url
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError("server not ready after 120 s")


def process_usage(pid: int) -> dict[str, int]:
    """RSS (KiB) and open file descriptors of a Linux process."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return {"rss_kib": rss, "fds": len(list(Path(f"/proc/{pid}/fd").iterdir()))}


async def gauges(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    wanted = (names.KV_CACHE_USAGE, names.REQUESTS_RUNNING, names.REQUESTS_WAITING,
              names.PREEMPTIONS_TOTAL)
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in wanted
    }


# -- the load -------------------------------------------------------------------------------


async def one_request(
    session: aiohttp.ClientSession, url: str, rng: random.Random, tally: Tally
) -> None:
    kind = rng.choice(("plain", "stream", "stream", "disconnect"))
    body = {
        "prompt": "soak " * rng.randint(2, 40),
        "max_tokens": rng.randint(4, 96),
        "ignore_eos": True,
        "stream": kind != "plain",
    }
    tally.sent += 1
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                answer = await response.json(content_type=None)
                if response.status in REJECTED or (
                    response.status == 400 and "error" in answer
                ):
                    tally.rejected += 1
                else:
                    tally.lose(f"HTTP {response.status}: {answer}")
                return
            if kind == "plain":
                answer = await response.json()
                ok = answer["usage"]["completion_tokens"] == body["max_tokens"]
                tally.ok += 1 if ok else 0
                if not ok:
                    tally.lose(f"short completion: {answer['usage']}")
                return
            await read_stream(response, kind, rng, tally)
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.lose(f"{type(exc).__name__}: {exc}")


async def read_stream(
    response: aiohttp.ClientResponse, kind: str, rng: random.Random, tally: Tally
) -> None:
    drop_after = rng.randint(1, 8) if kind == "disconnect" else None
    events = 0
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            tally.ok += 1
            return
        if '"error"' in line:
            tally.lose(f"error event: {line[:200]}")
            return
        events += 1
        if drop_after is not None and events >= drop_after:
            response.close()  # the client goes away mid-stream
            tally.disconnected += 1
            return
    tally.lose("stream ended without [DONE]")


async def client(url: str, until: float, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        while time.monotonic() < until:
            await one_request(session, url, rng, tally)


async def admin(url: str, until: float, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < until:
            body = {"max_batch_size": rng.randint(2, 8), "batch_timeout_ms": rng.choice((0, 5, 20))}
            async with session.put(f"{url}/admin/batching", json=body, headers=headers) as r:
                if r.status == 200:
                    tally.admin_puts += 1
                else:
                    tally.lose(f"admin PUT answered {r.status}: {await r.text()}")
            await asyncio.sleep(2.0)


async def soak(args: argparse.Namespace, url: str, pid: int) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        warm = Tally()
        await asyncio.gather(*(client(url, time.monotonic() + 5, i, warm) for i in range(4)))
        start_usage = process_usage(pid)
        tally = Tally()
        t0 = time.monotonic()
        until = t0 + args.duration_s
        await asyncio.gather(
            admin(url, until, args.seed, tally),
            *(client(url, until, args.seed + 1 + i, tally) for i in range(args.clients)),
        )
        elapsed = time.monotonic() - t0
        await asyncio.sleep(1.0)  # cancelled streams hand their blocks back
        after = await gauges(session, url)
    end_usage = process_usage(pid)
    growth = end_usage["rss_kib"] / start_usage["rss_kib"] - 1
    result: dict[str, Any] = {
        "duration_s": round(elapsed, 1),
        "clients": args.clients,
        "kv_cache_mb": args.kv_cache_mb,
        **{k: v for k, v in asdict(tally).items() if k != "lost_examples"},
        "kv_usage_after": after.get(names.KV_CACHE_USAGE),
        "running_after": after.get(names.REQUESTS_RUNNING),
        "waiting_after": after.get(names.REQUESTS_WAITING),
        "preemptions": after.get(names.PREEMPTIONS_TOTAL),
        "rss_mib_start": round(start_usage["rss_kib"] / 1024, 1),
        "rss_mib_end": round(end_usage["rss_kib"] / 1024, 1),
        "rss_growth": round(growth, 4),
        "fds_start": start_usage["fds"],
        "fds_end": end_usage["fds"],
    }
    result["passed"] = (
        tally.lost == 0 and not result["kv_usage_after"] and growth < RSS_GROWTH_TARGET
    )
    result["lost_examples"] = tally.lost_examples
    return result


def table(result: dict[str, Any]) -> str:
    rows = [
        ("duration", f"{result['duration_s']} s, {result['clients']} clients + 1 admin client, "
                     f"KV pool {result['kv_cache_mb']:g} MB"),
        ("requests sent / ok / rejected / lost",
         f"{result['sent']} / {result['ok']} / {result['rejected']} / {result['lost']}"),
        ("streams dropped by the client", str(result["disconnected"])),
        ("admin PUTs", str(result["admin_puts"])),
        ("preemptions (the KV pool ran out)", str(result["preemptions"])),
        ("KV usage after the load (0 = no block leaked)", str(result["kv_usage_after"])),
        ("running / waiting after", f"{result['running_after']} / {result['waiting_after']}"),
        ("RSS start -> end", f"{result['rss_mib_start']} -> {result['rss_mib_end']} MiB "
                             f"({result['rss_growth'] * 100:+.1f} %)"),
        ("open fds start -> end", f"{result['fds_start']} -> {result['fds_end']}"),
        ("targets (0 lost, 0 leaked, RSS < +10 %)", "met" if result["passed"] else "MISSED"),
    ]  # fmt: skip
    lines = ["| measure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="batchpilot-soak-") as token_dir:
        token_file = Path(token_dir) / "token"
        token_file.write_text(TOKEN)
        proc, url = start_server(args, token_file)
        try:
            result = asyncio.run(soak(args, url, proc.pid))
        finally:
            stop_process(proc)
    text = table(result)
    print(text)
    if not args.no_doc:
        replace_section(DOC, "soak", f"## Soak (`bench/soak.py`)\n\n{INTRO}\n\n{text}")
    print(json.dumps(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
