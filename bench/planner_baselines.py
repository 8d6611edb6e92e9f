"""Replicas-only controllers users run, as baselines for bench/planners.py (knobs fixed).

- `KedaRule`: KEDA's Prometheus trigger on vLLM's queue, as vLLM's production stack
  documents it (tutorials/assets/values-20-keda.yaml: query `vllm:num_requests_waiting`,
  `threshold: '5'`, an AverageValue target): `ceil(sum(waiting) / threshold)` replicas,
  handed to an HPA with its default behaviour (10% tolerance, up at once, down only to
  the highest recommendation of the last 300 s: bench/hpa.py's `hpa_decision`).
- `DynamoPlanner`: NVIDIA Dynamo's planner (ai-dynamo 1.6.1), its own code, in its own
  virtualenv (bench/peers/install_dynamo.sh), driven tick by tick over JSON lines by
  bench/peers/dynamo_planner_driver.py. Each round it gets the traffic over the interval
  (arrivals, mean prompt and answer lengths of the requests that finished), the worker
  counts (pods still starting included) and each ready engine's forward-pass metrics (its
  last step's scheduled requests and tokens and wall time, its queue), and its
  `scale_to` becomes the replica count, started with the same start-up delay as any pod.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
from batchpilot_operator.policy.types import Fleet, ReplicaBounds, ReplicaState, ScaleDecision
from batchpilot_operator.signals import Signals
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_tools.simulator import Interval, SimulatedFleet, SimulatedServer
from hpa import TOLERANCE, hpa_decision

# vLLM production stack's KEDA example (tutorials/assets/values-20-keda.yaml)
KEDA_WAITING_THRESHOLD = 5.0

PEERS = Path(__file__).resolve().parent / "peers"
DRIVER = PEERS / "dynamo_planner_driver.py"
STANDIN = PEERS / "dynamo_standin"  # aisimulate_core's stand-in (its README)
CACHE = Path(os.environ.get("BATCHPILOT_PEERS_CACHE", Path.home() / ".cache/batchpilot-peers"))
DYNAMO_PYTHON = CACHE / "dynamo-venv" / "bin" / "python"
DYNAMO_VERSION = "1.6.1"

DynamoTarget = Literal["sla", "throughput"]


def dynamo_installed() -> bool:
    return (DYNAMO_PYTHON.parent.parent / f".installed-ai-dynamo-{DYNAMO_VERSION}").exists()


@dataclass(frozen=True)
class KedaRule:
    """`ceil(sum(vllm:num_requests_waiting) / threshold)` through an HPA's defaults."""

    bounds: ReplicaBounds
    threshold: float = KEDA_WAITING_THRESHOLD

    def decide(
        self, signals: Signals, fleet: Fleet, state: ReplicaState, now: float
    ) -> ScaleDecision:
        current = fleet.desired
        waiting = signals.waiting or 0.0  # the gauge summed over the pods at the scrape
        # An AverageValue target: the HPA's ratio is the per-pod value over the threshold.
        ratio = waiting / (self.threshold * current)
        raw = current if abs(ratio - 1.0) <= TOLERANCE else math.ceil(waiting / self.threshold)
        reason = f"waiting {waiting:g} over threshold {self.threshold:g}"
        return hpa_decision(raw, current, self.bounds, state, now, reason)


# -- Dynamo's planner ---------------------------------------------------------------


def dynamo_config(
    target: DynamoTarget, slo: Slo, bounds: ReplicaBounds, interval_s: float
) -> dict[str, Any]:
    """The PlannerConfig a user writes for one aggregated vLLM-like deployment (Dynamo's
    Planner Guide): which options are set, and why, in the comments."""
    config: dict[str, Any] = {
        "mode": "agg",  # one engine does prefill and decode, as batchpilot's servers do
        "backend": "vllm",
        "optimization_target": target,
        # no Kubernetes: the simulator applies scale_to itself
        "environment": "virtual",
        # replica bounds as Dynamo takes them: a floor of endpoints, a GPU budget at one
        # GPU per replica
        "min_endpoint": bounds.min_replicas,
        "max_gpu_budget": bounds.max_replicas,
        "decode_engine_num_gpu": 1,
        # one tick per tuning interval, like every other controller here (default 5 s)
        "load_adjustment_interval_seconds": round(interval_s),
        "scheduling": {"scale_interval_seconds": interval_s},
        # no profiling sweep: the profiler needs AISimulate and GPUs; the guide's live
        # FPM-regression start is what remains
        "pre_deployment_sweeping_mode": "none",
        "control_api_port": 0,  # no local HTTP API inside a simulation
    }
    if target == "sla":
        # the scenario's targets; both scaling modes on, as the guide describes sla:
        # throughput-based (predictive, every 180 s, the default) gives a lower bound,
        # load-based reacts every tick
        config |= {
            "ttft_ms": 1000.0 * (slo.ttft_s or 0.0),
            "itl_ms": 1000.0 * (slo.tpot_s or 0.0),
            "enable_throughput_scaling": True,
            "enable_load_scaling": True,
        }
    return config


def dynamo_capabilities(
    config: BatchingConfig, kv_blocks: int, block_size: int, context_length: int
) -> dict[str, int]:
    """What Dynamo reads from a worker's model deployment card: its batch limits and KV."""
    return {
        "num_gpu": 1,
        "max_num_batched_tokens": config.prefill_token_budget,
        "max_num_seqs": config.max_batch_size,
        "max_kv_tokens": kv_blocks * block_size,
        "kv_cache_block_size": block_size,
        "context_length": context_length,
    }


def traffic_of(iv: Interval, interval_s: float) -> dict[str, float]:
    """The frontend's view of one interval: requests that arrived, and the mean prompt and
    answer lengths of those that finished (`shape_count` weighs them when merged)."""
    return traffic(
        interval_s, iv.arrived, float(np.sum(iv.prompts)), float(np.sum(iv.outputs)),
        len(iv.prompts),
    )  # fmt: skip


def traffic(
    duration_s: float, arrived: float, prompt_tokens: float, output_tokens: float, finished: float
) -> dict[str, float]:
    """The driver's traffic (Dynamo's `TrafficObservation`): arrivals, and mean lengths over
    the `finished` requests the token sums are of."""
    return {
        "duration_s": duration_s,
        "num_req": float(arrived),
        "isl": prompt_tokens / finished if finished else 0.0,
        "osl": output_tokens / finished if finished else 0.0,
        "shape_count": float(finished),
    }


def workers_of(fleet: SimulatedFleet) -> dict[str, Any]:
    """Ready engines, the count of record, and pods still starting (counted as pending only
    when nothing drains, as Dynamo's connector verifies)."""
    ready = sum(s.routable for s in fleet.servers)
    starting = [s for s in fleet.servers if s.live and not s.ready and s.drain_s is None]
    draining = any(s.live and s.drain_s is not None for s in fleet.servers)
    return workers(ready, fleet.desired, len(starting), draining)


def workers(ready: int, desired: int, starting: int, draining: bool) -> dict[str, Any]:
    """The driver's worker counts (Dynamo's `WorkerCounts`)."""
    return {
        "ready": ready,
        "expected": desired,
        "pending": 0 if draining else starting,
        "in_progress": desired != ready,
    }


def fpm_of(server: SimulatedServer) -> dict[str, Any]:
    """One engine's forward-pass metrics: its last step and its queue now."""
    step = server.last_step
    waiting = list(server.scheduler.waiting)  # type: ignore[attr-defined]
    if step is None:
        return fpm(server.name, StepShape(), len(waiting), 0)
    shape = StepShape(
        step.seconds, step.prefill_requests, step.prefill_tokens, step.decode_requests,
        step.kv_tokens,
    )  # fmt: skip
    return fpm(server.name, shape, len(waiting), sum(seq.num_uncomputed for seq in waiting))


@dataclass(frozen=True)
class StepShape:
    """What one engine step scheduled, and its wall time (0 for an engine yet to step)."""

    seconds: float = 0.0
    prefill_requests: int = 0
    prefill_tokens: int = 0
    decode_requests: int = 0
    kv_tokens: int = 0


def fpm(worker_id: str, step: StepShape, queued: int, queued_tokens: int) -> dict[str, Any]:
    """The driver's forward-pass metrics of one engine (Dynamo's `ForwardPassMetrics`),
    from the simulator's last step or a real server's scraped step counters."""
    return {
        "worker_id": worker_id,
        "wall_time": step.seconds,
        "scheduled": {
            "num_prefill_requests": step.prefill_requests,
            "sum_prefill_tokens": step.prefill_tokens,
            "num_decode_requests": step.decode_requests,
            "sum_decode_kv_tokens": step.kv_tokens,
        },
        "queued": {"num_prefill_requests": queued, "sum_prefill_tokens": queued_tokens},
    }


def tick_request(fleet: SimulatedFleet) -> dict[str, Any]:
    """The driver's tick request at a round, from the fleet as it stands."""
    return tick(
        fleet.now,
        traffic_of(fleet.intervals[-1], fleet.opt.cadence.interval_s),
        workers_of(fleet),
        [fpm_of(s) for s in fleet.servers if s.routable],
    )


def tick(
    now_s: float, traffic: dict[str, float], workers: dict[str, Any], fpms: list[dict[str, Any]]
) -> dict[str, Any]:
    """A tick request of the driver's line protocol (its module docstring)."""
    return {"op": "tick", "now_s": now_s, "traffic": traffic, "workers": workers, "fpms": fpms}


class DynamoError(RuntimeError):
    pass


class DynamoProcess:
    """The driver in Dynamo's virtualenv: one request line in, one reply line out."""

    def __init__(self, python: Path = DYNAMO_PYTHON) -> None:
        # Dynamo logs every tick: to a file, read back only to explain a failure
        self.log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        env = {**os.environ, "PYTHONPATH": str(STANDIN)}
        # started from the cache: the repository's operator/ would shadow the stdlib's
        self.proc = subprocess.Popen(
            [str(python), str(DRIVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, env=env, cwd=str(CACHE),
        )  # fmt: skip

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise DynamoError(f"the Dynamo driver exited: {self._log_tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise DynamoError(f"Dynamo's planner failed on {request['op']}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            # also at interpreter exit (from __del__), when the pipes may be gone already
            with contextlib.suppress(DynamoError, OSError, ValueError):
                self.call({"op": "stop"})
            self.proc.wait(timeout=30)
        self.log.close()

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]


class DynamoPlanner:
    """A ReplicaController (and the simulator's FleetObserver) whose decisions are Dynamo's
    planner's. The driver starts at a fleet's first round (options are pickled to the
    benchmark's worker processes, a process is not) and again for a new fleet."""

    def __init__(
        self,
        target: DynamoTarget,
        config: dict[str, Any],
        capabilities: dict[str, int],
        bounds: ReplicaBounds,
    ) -> None:
        self.target = target
        self.config = config
        self.capabilities = capabilities
        self.bounds = bounds
        self.process: DynamoProcess | None = None
        self.fleet_id: int | None = None
        self.request: dict[str, Any] | None = None
        self.effective: dict[str, Any] = {}  # the config as Dynamo resolved it
        self.replies: list[dict[str, Any]] = []

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "process": None, "fleet_id": None}

    def observe(self, fleet: SimulatedFleet) -> None:
        self.observe_tick(id(fleet), tick_request(fleet))

    def observe_tick(self, fleet_id: int, request: dict[str, Any]) -> None:
        """The next `decide` sends `request`; a new `fleet_id` starts a fresh driver (a
        real fleet's ticks come from its scraped metrics: bench/planners_real.py)."""
        if fleet_id != self.fleet_id:
            self.close()
            self.process = DynamoProcess()
            start = {"op": "start", "config": self.config, "capabilities": self.capabilities}
            self.effective = self.process.call(start)["effective"]
            self.fleet_id, self.replies = fleet_id, []
        self.request = request

    def decide(
        self, signals: Signals, fleet: Fleet, state: ReplicaState, now: float
    ) -> ScaleDecision:
        if self.process is None or self.request is None:
            raise DynamoError("DynamoPlanner.decide before observe: run it in the simulator")
        reply = self.process.call(self.request)
        self.replies.append(reply)
        current = fleet.desired
        wanted = reply["scale_to"]
        reason = f"dynamo {self.target}: {reply.get('reason') or 'no tick'}"
        if wanted is None:
            return ScaleDecision(current, "hold", reason, state)
        replicas = self.bounds.clamp(int(wanted))
        if replicas == current:
            return ScaleDecision(current, "hold", reason, state)
        action = "scale_out" if replicas > current else "scale_in"
        return ScaleDecision(replicas, action, f"{current} -> {replicas}: {reason}", state)

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
            self.process = None

    def __del__(self) -> None:
        self.close()
