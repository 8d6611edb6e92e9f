"""Load generator for OpenAI-compatible completion servers (`batchpilot loadgen`).

Arrivals are Poisson, fixed-rate (optionally following a rate schedule) or a
fixed number of concurrent clients; a run lasts a duration or a request
count. Requests go round-robin to one or more servers, streamed, so that
time to first token and inter-token latency are seen from the client. The
servers may change while a run lasts (`Targets`: a local fleet scaling): a
server leaves the rotation first and is stopped only once nothing sent to it
is still unanswered, as a load balancer deregisters a pod before it stops.

    report = await run_load(LoadSpec(urls=["http://127.0.0.1:8000"], rate=20, duration_s=10))
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import numpy as np
from batchpilot_server.http.slo_class import OBJECTIVE_HEADER  # how a request names its class

Arrival = Literal["poisson", "fixed", "concurrency"]
ARRIVALS: tuple[Arrival, ...] = ("poisson", "fixed", "concurrency")
PERCENTILES = (50, 90, 99)
# When a rate schedule says 0 req/s, how often to look again.
IDLE_RECHECK_S = 0.05
PROMPT_ALPHABET = "abcdefghijklmnopqrstuvwxyz "


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: fixed:N, uniform:LO,HI or lognormal:MEDIAN,SIGMA."""

    kind: Literal["fixed", "uniform", "lognormal"] = "fixed"
    a: float = 32
    b: float = 0
    low: int = 1
    high: int = 4096

    @classmethod
    def parse(cls, text: str, *, low: int = 1, high: int = 4096) -> LengthDist:
        kind, _, params = text.partition(":")
        try:
            values = [float(v) for v in params.split(",")] if params else []
        except ValueError:
            values = []
        expected = {"fixed": 1, "uniform": 2, "lognormal": 2}
        if kind not in expected or len(values) != expected[kind]:
            raise ValueError(
                f"bad length distribution {text!r}: use fixed:N, uniform:LO,HI or "
                "lognormal:MEDIAN,SIGMA"
            )
        dist = cls(kind, values[0], values[1] if len(values) > 1 else 0, low, high)  # type: ignore[arg-type]
        if kind == "uniform" and not 0 < dist.a <= dist.b:
            raise ValueError(f"bad uniform range {text!r}: need 0 < LO <= HI")
        if dist.a <= 0 or dist.b < 0:
            raise ValueError(f"bad length distribution {text!r}: parameters must be positive")
        return dist

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        else:
            value = rng.lognormvariate(math.log(self.a), self.b)
        return max(self.low, min(self.high, round(value)))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        return f"{self.kind}:{self.a:g},{self.b:g}"


@dataclass
class LoadSpec:
    urls: list[str]
    arrival: Arrival = "poisson"
    rate: float = 10.0  # requests/s for poisson and fixed
    # Requests/s as a function of seconds since the start; overrides `rate`.
    rate_schedule: Callable[[float], float] | None = None
    concurrency: int = 8  # clients for arrival="concurrency"
    duration_s: float | None = None  # stop sending after this long ...
    num_requests: int | None = None  # ... or after this many requests (whichever first)
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 32))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 32))
    ignore_eos: bool = True  # outputs have exactly the sampled length
    stream: bool = True  # False: one JSON answer per request, so no TTFT / inter-token
    temperature: float = 0.0
    model: str | None = None
    timeout_s: float = 120.0  # per request
    # False: a new connection per request. llama.cpp's llama-server closes a connection
    # after a streamed answer while announcing keep-alive; a request sent on it fails.
    reuse_connections: bool = True
    seed: int = 0
    progress: bool = False  # progress bar on stderr
    # The SLO class every request names (the x-gateway-inference-objective header, as the
    # Gateway API Inference Extension sets it); None: no header, the server's default.
    objective: str | None = None

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("give at least one server URL")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}")
        if self.duration_s is None and self.num_requests is None:
            raise ValueError("give a duration, a request count, or both")
        if self.arrival == "concurrency" and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.arrival != "concurrency" and self.rate_schedule is None and self.rate <= 0:
            raise ValueError("rate must be positive")
        if self.objective is not None and not self.objective.strip():
            raise ValueError("an objective (SLO class) name must not be empty")


@dataclass
class RequestResult:
    url: str
    start_s: float  # since the start of the run
    end_s: float
    status: int  # HTTP status; 0 when no answer came (connection error, timeout)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    expected_tokens: int = 0
    ttft_s: float | None = None
    inter_token_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token as an SLO judges it: the mean gap between tokens after
        the first; None where fewer than two came."""
        return sum(self.inter_token_s) / len(self.inter_token_s) if self.inter_token_s else None

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class LoadReport:
    duration_s: float
    sent: int
    ok: int
    errors_by_status: dict[str, int]
    requests_per_s: float
    tokens_per_s: float  # generated tokens of successful requests per second
    ttft_s: dict[str, float | None]  # p50 / p90 / p99
    inter_token_s: dict[str, float | None]
    latency_s: dict[str, float | None]
    results: list[RequestResult] = field(repr=False, default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "duration_s": round(self.duration_s, 3),
            "sent": self.sent,
            "ok": self.ok,
            "errors_by_status": self.errors_by_status,
            "requests_per_s": round(self.requests_per_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "ttft_s": self.ttft_s,
            "inter_token_s": self.inter_token_s,
            "latency_s": self.latency_s,
        }

    def table(self) -> str:
        lines = [
            f"duration {self.duration_s:.2f} s, sent {self.sent}, ok {self.ok}, "
            f"errors {self.errors_by_status or 'none'}",
            f"throughput {self.requests_per_s:.2f} req/s, {self.tokens_per_s:.1f} tokens/s",
            f"{'latency (ms)':<16}{'p50':>10}{'p90':>10}{'p99':>10}",
        ]
        for name, values in (
            ("ttft", self.ttft_s),
            ("inter-token", self.inter_token_s),
            ("end-to-end", self.latency_s),
        ):
            cells = "".join(f"{_ms(values[f'p{p}']):>10}" for p in PERCENTILES)
            lines.append(f"{name:<16}{cells}")
        return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    points = np.percentile(np.asarray(values), PERCENTILES)
    return {f"p{p}": round(float(v), 6) for p, v in zip(PERCENTILES, points, strict=True)}


def summarize(results: list[RequestResult], duration_s: float) -> LoadReport:
    ok = [r for r in results if r.ok]
    errors = Counter("connection" if r.status == 0 else str(r.status) for r in results if not r.ok)
    span = max(duration_s, 1e-9)
    return LoadReport(
        duration_s=duration_s,
        sent=len(results),
        ok=len(ok),
        errors_by_status=dict(sorted(errors.items())),
        requests_per_s=len(ok) / span,
        tokens_per_s=sum(r.completion_tokens for r in ok) / span,
        ttft_s=percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        inter_token_s=percentiles([gap for r in ok for gap in r.inter_token_s]),
        latency_s=percentiles([r.latency_s for r in ok]),
        results=results,
    )


class Targets:
    """The servers a run sends to, round robin, and what each still owes it.

    `add` and `remove` take effect at the next request; a removed server still
    answers what it was sent, and `wait_unanswered` says when it has.
    """

    def __init__(self, urls: list[str]) -> None:
        if not urls:
            raise ValueError("give at least one server URL")
        self.urls = list(urls)
        self._turn = 0
        self._unanswered: Counter[str] = Counter()
        self._an_end = asyncio.Event()

    def add(self, url: str) -> None:
        if url not in self.urls:
            self.urls.append(url)

    def remove(self, url: str) -> None:
        if url in self.urls and len(self.urls) == 1:
            raise ValueError(f"{url} is the last server: a load needs at least one")
        if url in self.urls:
            self.urls.remove(url)

    def pick(self) -> str:
        """The next server in turn; it owes an answer until `ended(url)`."""
        url = self.urls[self._turn % len(self.urls)]
        self._turn += 1
        self._unanswered[url] += 1
        return url

    def unanswered(self, url: str) -> int:
        """Requests sent to `url` that have not ended yet."""
        return self._unanswered[url]

    def ended(self, url: str) -> None:
        self._unanswered[url] -= 1
        self._an_end.set()

    async def wait_unanswered(self, url: str, timeout_s: float) -> bool:
        """Wait until every request sent to `url` has ended; False if some had not by
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self._unanswered[url] > 0:
            self._an_end.clear()
            try:
                await asyncio.wait_for(self._an_end.wait(), deadline - time.monotonic())
            except TimeoutError:
                return self._unanswered[url] == 0
        return True


class Progress:
    """A one-line progress bar on stderr."""

    WIDTH = 30

    def __init__(self, spec: LoadSpec, enabled: bool) -> None:
        self.spec = spec
        self.enabled = enabled
        self.done = 0
        self.failed = 0
        self._last_draw = 0.0

    def update(self, result: RequestResult, elapsed_s: float) -> None:
        self.done += 1
        self.failed += not result.ok
        if self.enabled and time.monotonic() - self._last_draw > 0.2:
            self._last_draw = time.monotonic()
            self.draw(elapsed_s)

    def draw(self, elapsed_s: float) -> None:
        fractions = []
        if self.spec.duration_s:
            fractions.append(elapsed_s / self.spec.duration_s)
        if self.spec.num_requests:
            fractions.append(self.done / self.spec.num_requests)
        fraction = min(1.0, max(fractions))
        bar = "#" * int(fraction * self.WIDTH)
        sys.stderr.write(
            f"\r[{bar:<{self.WIDTH}}] {self.done} done, {self.failed} failed, "
            f"{elapsed_s:.1f}s, {self.done / max(elapsed_s, 1e-9):.1f} req/s "
        )
        sys.stderr.flush()

    def close(self, elapsed_s: float) -> None:
        if self.enabled:
            self.draw(elapsed_s)
            sys.stderr.write("\n")


class _Run:
    """One load run: sends requests, collects results."""

    def __init__(
        self,
        spec: LoadSpec,
        session: aiohttp.ClientSession,
        on_result: Callable[[RequestResult], None] | None,
        targets: Targets,
    ) -> None:
        self.spec = spec
        self.session = session
        self.on_result = on_result
        self.rng = random.Random(spec.seed)
        self.targets = targets
        self.results: list[RequestResult] = []
        self.started = 0
        self.t0 = time.monotonic()
        self.progress = Progress(spec, spec.progress)
        # Only a load that names a class sends the header: without one, requests as before.
        self.headers = {OBJECTIVE_HEADER: spec.objective} if spec.objective else None

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def may_start(self) -> bool:
        spec = self.spec
        if spec.num_requests is not None and self.started >= spec.num_requests:
            return False
        return spec.duration_s is None or self.elapsed() < spec.duration_s

    def rate_now(self) -> float:
        schedule = self.spec.rate_schedule
        return max(0.0, schedule(self.elapsed())) if schedule else self.spec.rate

    async def open_loop(self) -> None:
        """Poisson or fixed-rate arrivals, independent of how fast answers come."""
        tasks: set[asyncio.Task[None]] = set()
        try:
            await self._arrivals(tasks)
            if tasks:
                await asyncio.gather(*tasks)
        finally:  # cancelled: requests in flight go too, not left behind the closed session
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _arrivals(self, tasks: set[asyncio.Task[None]]) -> None:
        next_at = self.elapsed()
        while True:
            rate = self.rate_now()
            if rate <= 0:
                await asyncio.sleep(IDLE_RECHECK_S)
                next_at = self.elapsed()
                if not self.may_start():
                    break
                continue
            gap = self.rng.expovariate(rate) if self.spec.arrival == "poisson" else 1.0 / rate
            next_at += gap
            await asyncio.sleep(max(0.0, next_at - self.elapsed()))
            if not self.may_start():
                break
            task = asyncio.create_task(self.one_request())
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def closed_loop(self) -> None:
        """`concurrency` clients, each sending its next request when the last one ends."""

        async def client() -> None:
            while self.may_start():
                await self.one_request()

        await asyncio.gather(*(client() for _ in range(self.spec.concurrency)))

    async def one_request(self) -> None:
        self.started += 1
        prompt_tokens = self.spec.prompt_len.sample(self.rng)
        max_tokens = self.spec.output_len.sample(self.rng)
        prompt = "".join(self.rng.choice(PROMPT_ALPHABET) for _ in range(prompt_tokens))
        url = self.targets.pick()
        result = RequestResult(url, self.elapsed(), 0.0, 0, expected_tokens=max_tokens)
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": self.spec.temperature,
            "ignore_eos": self.spec.ignore_eos,
            "stream": self.spec.stream,
        }
        if self.spec.model:
            body["model"] = self.spec.model
        try:
            await asyncio.wait_for(self._stream(url, body, result), self.spec.timeout_s)
        except TimeoutError:
            result.error = f"no answer within {self.spec.timeout_s:g}s"
            result.status = 0
        except aiohttp.ClientError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            result.status = 0
        finally:
            self.targets.ended(url)
        result.end_s = self.elapsed()
        self.results.append(result)
        self.progress.update(result, result.end_s)
        if self.on_result is not None:
            self.on_result(result)

    async def _stream(self, url: str, body: dict[str, Any], result: RequestResult) -> None:
        endpoint = f"{url.rstrip('/')}/v1/completions"
        async with self.session.post(endpoint, json=body, headers=self.headers) as response:
            result.status = response.status
            if response.status != 200:
                result.error = await _error_message(response)
                return
            if not self.spec.stream:
                _record_usage(result, (await response.json()).get("usage"))
                return
            last = None
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                now = self.elapsed()
                has_token = True
                # A full parse only where it matters: at batch 32 the client reads thousands
                # of token events a second and shares the CPU with the server.
                if b'"usage"' in data or b'"error"' in data:
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = chunk["error"].get("message", "error event in stream")
                        return
                    _record_usage(result, chunk.get("usage"))
                    has_token = bool(chunk.get("choices"))
                if has_token:
                    if last is None:
                        result.ttft_s = now - result.start_s
                    else:
                        result.inter_token_s.append(now - last)
                    last = now
            result.error = "stream ended without data: [DONE]"


def _record_usage(result: RequestResult, usage: dict[str, int] | None) -> None:
    if usage:
        result.prompt_tokens = usage["prompt_tokens"]
        result.completion_tokens = usage["completion_tokens"]


async def _error_message(response: aiohttp.ClientResponse) -> str:
    try:
        return str((await response.json())["error"]["message"])
    except (aiohttp.ContentTypeError, json.JSONDecodeError, KeyError, TypeError):
        return f"HTTP {response.status}"


async def run_load(
    spec: LoadSpec,
    on_result: Callable[[RequestResult], None] | None = None,
    targets: Targets | None = None,
) -> LoadReport:
    """Drive `spec` against its servers; `on_result` sees every request as it ends.

    `targets`, when given, replaces `spec.urls` and may change while the run lasts.
    """
    connector = aiohttp.TCPConnector(limit=0, force_close=not spec.reuse_connections)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        run = _Run(spec, session, on_result, targets or Targets(spec.urls))
        if spec.arrival == "concurrency":
            await run.closed_loop()
        else:
            await run.open_loop()
        elapsed = run.elapsed()
        run.progress.close(elapsed)
    return summarize(run.results, elapsed)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="batchpilot loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", action="append", required=True, help="server URL (repeatable)")
    p.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    p.add_argument("--rate", type=float, default=10.0, help="requests/s (poisson, fixed)")
    p.add_argument("--concurrency", type=int, default=8, help="clients (concurrency)")
    p.add_argument("--duration", type=float, help="seconds to send for")
    p.add_argument("--requests", type=int, help="number of requests to send")
    p.add_argument("--prompt-len", default="fixed:32", help="fixed:N | uniform:LO,HI | ...")
    p.add_argument("--output-len", default="fixed:32", help="... | lognormal:MEDIAN,SIGMA")
    p.add_argument("--no-ignore-eos", action="store_true", help="let outputs end at EOS")
    p.add_argument("--no-stream", action="store_true", help="no SSE: no TTFT / inter-token")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--objective",
        help="the SLO class every request names (the x-gateway-inference-objective header)",
    )
    p.add_argument("--no-progress", action="store_true")
    return p


def spec_from_args(args: argparse.Namespace) -> LoadSpec:
    return LoadSpec(
        urls=args.url,
        arrival=args.arrival,
        rate=args.rate,
        concurrency=args.concurrency,
        duration_s=args.duration,
        num_requests=args.requests,
        prompt_len=LengthDist.parse(args.prompt_len),
        output_len=LengthDist.parse(args.output_len),
        ignore_eos=not args.no_ignore_eos,
        stream=not args.no_stream,
        temperature=args.temperature,
        model=args.model,
        timeout_s=args.timeout,
        seed=args.seed,
        objective=args.objective,
        progress=not args.no_progress and sys.stderr.isatty(),
    )


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        spec = spec_from_args(args)
    except ValueError as exc:
        print(f"batchpilot loadgen: error: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(run_load(spec))
    print(report.table())
    print(json.dumps(report.to_dict()))
    return 0 if report.ok else 1
