"""The batch slot waste of a run: each server's slot-step counters, read from its own
`/metrics` once the load has ended (a server starts with the run or with a scale-out,
so its counters cover its whole part), or, for a server a scale-in stopped, just
before its stop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
from batchpilot_server import metric_names as names
from batchpilot_tools.demo.supervisor import ServerProcess
from prometheus_client.parser import text_string_to_metric_families

# Short: a Ctrl-C'd demo should not wait long for a summary line.
SCRAPE_TIMEOUT_S = 3.0
_, FINISHED, PADDING = names.SLOT_STATES  # the two wasted states


@dataclass(frozen=True)
class SlotSteps:
    """Batch slot-steps by state (metric_names.SLOT_STATES), and the batching modes that
    counted them (the series' `mode` label)."""

    by_state: dict[str, float] = field(default_factory=dict)
    modes: frozenset[str] = frozenset()

    @property
    def total(self) -> float:
        return sum(self.by_state.values())

    def share(self, *states: str) -> float | None:
        """The share of all slot-steps that were in `states`; None before any batch ran."""
        if not self.total:
            return None
        return sum(self.by_state.get(state, 0.0) for state in states) / self.total

    @property
    def waste(self) -> float | None:
        return self.share(FINISHED, PADDING)


def combined(parts: Iterable[SlotSteps]) -> SlotSteps:
    by_state: dict[str, float] = {}
    modes: set[str] = set()
    for part in parts:
        for state, count in part.by_state.items():
            by_state[state] = by_state.get(state, 0.0) + count
        modes |= part.modes
    return SlotSteps(by_state, frozenset(modes))


def parse_slot_steps(text: str) -> SlotSteps:
    """The slot-step counters of one `/metrics` page."""
    parts = [
        SlotSteps({sample.labels["state"]: float(sample.value)}, frozenset({sample.labels["mode"]}))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == names.BATCH_SLOT_STEPS_TOTAL
    ]
    return combined(parts)


@dataclass(frozen=True)
class SlotWaste:
    """Per server name: its slot-steps, or None where its `/metrics` could not be read."""

    per_server: dict[str, SlotSteps | None]

    @property
    def overall(self) -> SlotSteps:
        return combined(steps for steps in self.per_server.values() if steps is not None)


async def read_slot_steps(
    server: ServerProcess, session: aiohttp.ClientSession
) -> SlotSteps | None:
    try:
        async with session.get(f"{server.url}/metrics") as response:
            if response.status != 200:
                return None
            return parse_slot_steps(await response.text())
    except (aiohttp.ClientError, TimeoutError):
        return None


async def read_slot_waste(
    servers: list[ServerProcess], retired: Mapping[str, SlotSteps | None] | None = None
) -> SlotWaste:
    """The running `servers`' counters now, with those read from `retired` servers."""
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        read = await asyncio.gather(*(read_slot_steps(server, session) for server in servers))
    running = {server.name: steps for server, steps in zip(servers, read, strict=True)}
    return SlotWaste({**running, **(retired or {})})
