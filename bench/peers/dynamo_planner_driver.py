"""Drives NVIDIA Dynamo's planner core (ai-dynamo 1.6.1) over JSON lines on stdin/stdout.

Runs in the Dynamo virtualenv (bench/peers/install_dynamo.sh), never in batchpilot's: the
client is bench/planner_baselines.py. The tick engine is the one Dynamo's own offline
replay drives (`dynamo/planner/offline/replay_adapter.py`): `OrchestratorEngineAdapter`
with a `VirtualClock`, `initial_tick` once, then `tick(ScheduledTick, TickInput)` ->
`PlannerEffects`, whose `scale_to.num_decode` is the aggregated fleet's replica count.

Requests, one JSON object a line; one reply line each:
  {"op": "start", "config": {PlannerConfig fields}, "capabilities": {EngineCapabilities}}
      -> {"ok": true, "effective": {...}, "next_at_s": float}
  {"op": "tick", "now_s": float, "traffic": {"duration_s", "num_req", "isl", "osl"},
   "workers": {"ready", "expected", "pending", "in_progress"},
   "fpms": [{"worker_id", "wall_time", "scheduled": {...}, "queued": {...}}]}
      -> {"ok": true, "ticked": bool, "scale_to": int | null, "reason": str | null, ...}
  {"op": "stop"} -> {"ok": true}
Traffic accumulates between the engine's own ticks, as the replay adapter merges it, so a
throughput tick sees its whole window. Dynamo's logs go to stderr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any, TextIO

from dynamo.common.forward_pass_metrics import (
    ForwardPassMetrics,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
)
from dynamo.planner.config.planner_config import PlannerConfig
from dynamo.planner.core.types import (
    EngineCapabilities,
    FpmObservations,
    ScheduledTick,
    TickInput,
    TrafficObservation,
    WorkerCapabilities,
    WorkerCounts,
)
from dynamo.planner.plugins.clock import VirtualClock
from dynamo.planner.plugins.orchestrator.engine_adapter import OrchestratorEngineAdapter

EPS_S = 1e-6


class Driver:
    def __init__(self) -> None:
        self.engine: OrchestratorEngineAdapter | None = None
        self.pending: ScheduledTick | None = None
        self.traffic: dict[str, float] = {}  # accumulated since the last traffic tick

    async def start(self, request: dict[str, Any]) -> dict[str, Any]:
        config = PlannerConfig.model_validate(request["config"])
        caps = WorkerCapabilities(decode=EngineCapabilities(**request["capabilities"]))
        self.engine = OrchestratorEngineAdapter(config, caps, clock=VirtualClock())
        await self.engine.bootstrap_plugins(historical_traffic=None)
        self.pending = self.engine.initial_tick(0.0)
        effective = {
            k: getattr(config, k)
            for k in (
                "mode", "optimization_target", "enable_load_scaling",
                "enable_throughput_scaling", "ttft_ms", "itl_ms",
                "load_adjustment_interval_seconds", "throughput_adjustment_interval_seconds",
                "load_predictor", "min_endpoint", "max_gpu_budget",
            )
        }  # fmt: skip
        return {"ok": True, "effective": effective, "next_at_s": self.pending.at_s}

    def _accumulate(self, traffic: dict[str, float] | None) -> None:
        """Sum requests and seconds; lengths weighted by the requests they were read from."""
        if not traffic:
            return
        acc = self.traffic
        n_old, n_new = acc.get("shape_count", 0.0), traffic.get("shape_count", 0.0)
        for key in ("isl", "osl"):
            total = n_old + n_new
            acc[key] = (
                (acc.get(key, 0.0) * n_old + traffic[key] * n_new) / total if total else 0.0
            )
        acc["shape_count"] = n_old + n_new
        acc["num_req"] = acc.get("num_req", 0.0) + traffic["num_req"]
        acc["duration_s"] = acc.get("duration_s", 0.0) + traffic["duration_s"]

    async def tick(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.engine is not None and self.pending is not None, "start first"
        self._accumulate(request.get("traffic"))
        tick = self.pending
        if request["now_s"] + EPS_S < tick.at_s:  # not due: the engine keeps its own cadence
            return {"ok": True, "ticked": False, "scale_to": None, "next_at_s": tick.at_s}
        effects = await self.engine.tick(tick, self._input(tick, request))
        if effects.next_tick is not None:
            self.pending = effects.next_tick
        scale = effects.scale_to
        diag = effects.diagnostics
        return {
            "ok": True,
            "ticked": True,
            "scale_to": None if scale is None else scale.num_decode,
            "reason": diag.load_decision_reason,
            "throughput_reason": diag.throughput_decision_reason,
            "estimated_ttft_ms": diag.estimated_ttft_ms,
            "estimated_itl_ms": diag.estimated_itl_ms,
            "engine_rps": diag.engine_rps_decode,
            "throughput_lower_bound": diag.throughput_lower_bound_decode,
            "next_at_s": self.pending.at_s,
        }

    def _input(self, tick: ScheduledTick, request: dict[str, Any]) -> TickInput:
        """What the tick asked for (the replay adapter's `_build_tick_input`, from our
        fleet instead of its Rust mocker)."""
        traffic = None
        if tick.need_traffic_metrics and self.traffic.get("duration_s", 0.0) > 0:
            t, self.traffic = self.traffic, {}
            traffic = TrafficObservation(
                duration_s=t["duration_s"], num_req=t["num_req"], isl=t["isl"], osl=t["osl"]
            )
        workers = None
        if tick.need_worker_states:
            w = request["workers"]
            workers = WorkerCounts(
                ready_num_decode=w["ready"],
                expected_num_decode=w["expected"],
                decode_scaling_in_progress=w["in_progress"],
                pending_num_decode=w["pending"],
            )
        fpms = None
        if tick.need_worker_fpm and request["fpms"]:
            fpms = FpmObservations(
                decode={(f["worker_id"], 0): _fpm(f) for f in request["fpms"]}
            )
        return TickInput(
            now_s=tick.at_s, traffic=traffic, worker_counts=workers, fpm_observations=fpms
        )


def _fpm(f: dict[str, Any]) -> ForwardPassMetrics:
    return ForwardPassMetrics(
        worker_id=f["worker_id"],
        dp_rank=0,
        wall_time=f["wall_time"],
        scheduled_requests=ScheduledRequestMetrics(**f["scheduled"]),
        queued_requests=QueuedRequestMetrics(**f["queued"]),
    )


async def serve(lines: TextIO, out: TextIO) -> None:
    driver = Driver()
    handlers = {"start": driver.start, "tick": driver.tick}
    for line in lines:
        request = json.loads(line)
        if request["op"] == "stop":
            out.write(json.dumps({"ok": True}) + "\n")
            out.flush()
            break
        try:
            reply = await handlers[request["op"]](request)
        except Exception as error:  # the client shows it with the request that caused it
            reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    if driver.engine is not None:
        await driver.engine.shutdown()


def main() -> None:
    # The protocol owns stdout; anything Dynamo prints goes to stderr with its logs.
    out, sys.stdout = sys.stdout, sys.stderr
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(serve(sys.stdin, out))


if __name__ == "__main__":
    main()
