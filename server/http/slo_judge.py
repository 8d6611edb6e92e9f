"""Each finished request judged against the SLO targets in force, exactly (not from buckets).

Torch-free. A request's timing is what its client saw: ttft from arrival to its first
token, tpot the mean time per output token after the first, e2e from arrival to its
last byte. A request the server failed (refused with 429, or ended 503/504) misses every
stated target; the caller leaves out requests that are the client's fault (a 400).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchpilot_server.batching_config import SloClass, SloTargets

ALL = "all"  # the target label of the verdict on every stated target together


@dataclass
class TokenTimes:
    """One choice's output tokens as the handler received them."""

    first_s: float
    last_s: float
    count: int = 1

    def add(self, at_s: float) -> None:
        self.last_s = at_s
        self.count += 1

    @property
    def tpot_s(self) -> float | None:
        """(last - first) / (tokens - 1); None for a one-token answer, which has no gap."""
        if self.count < 2:
            return None
        return (self.last_s - self.first_s) / (self.count - 1)


@dataclass
class RequestTiming:
    """A request's token times, per choice (`n` > 1 streams several), from its arrival."""

    arrival_s: float
    choices: dict[int, TokenTimes] = field(default_factory=dict)

    def token(self, choice: int, at_s: float) -> None:
        times = self.choices.get(choice)
        if times is None:
            self.choices[choice] = TokenTimes(at_s, at_s)
        else:
            times.add(at_s)

    @property
    def ttft_s(self) -> float | None:
        """Arrival to the first token of any choice; None: no token yet."""
        if not self.choices:
            return None
        return min(times.first_s for times in self.choices.values()) - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """The worst choice's mean time per output token after its first (each choice is
        a stream its reader waits on); None when every choice has one token or none."""
        values = [t for times in self.choices.values() if (t := times.tpot_s) is not None]
        return max(values, default=None)


def judge(
    targets: SloClass | SloTargets, timing: RequestTiming | None, end_s: float
) -> dict[str, bool]:
    """{target: met} for each target stated (by a class, or the top-level, default ones)
    and "all"; {} when none is stated.

    `timing` None: the server failed the request (rejected, timed out): every stated
    target is missed. A one-token answer meets tpot trivially; an answer that ended
    before its first token (nothing generated) misses ttft."""
    stated = targets.stated
    if not stated:
        return {}
    if timing is None:
        verdict = dict.fromkeys(stated, False)
    else:
        measured = {
            "ttft": timing.ttft_s,
            "tpot": timing.tpot_s,
            "e2e": end_s - timing.arrival_s,
        }
        verdict = {}
        for name, target_ms in stated.items():
            value = measured[name]
            if value is None:  # tpot of a one-token answer: holds; ttft without a token: not
                verdict[name] = name == "tpot" and timing.ttft_s is not None
            else:
                verdict[name] = value * 1000.0 <= target_ms
    verdict[ALL] = all(verdict.values())
    return verdict
