"""The predictor: p99 TTFT, TPOT and end to end, and the attainment, of one candidate config
at the window's measured demand, under the fitted step time.

Pure and explainable: a queueing approximation, no simulation. For a candidate
(max_batch_size B, batch_timeout_ms T, prefill_token_budget G, replicas N), with the
window's arrivals `lam` per pod (the forecast over N pods), its prompt and output lengths
as three points (window.py) and the step model `step(rows, prefill, kv)`:

1. The step at this load: each request holds a batch slot for its prefill steps
   (`ceil(P / G)`) and its `O - 1` decode steps, so the decode rows are
   `R = lam * (O - 1) * step` (Little's law; at most the slots' decoding share), prompt
   tokens per step
   `x = min(G, lam * mean P * step)`, KV tokens per step `R * (mean P + mean O / 2)`;
   `step` is the fixed point of the three. The pod's capacity `mu` is the same with all
   B slots busy: `B / slot_s`; `rho = lam / mu`.
2. The wait for a slot: the chance that all B slots are held, from the birth-death
   chain of the requests a pod holds, where with n held the steps are those of n
   slots' rows (a pod's steps lengthen with its rows, so a pod holding a third of its
   slots at this load almost never fills them, though at the full step's pace it would
   be two thirds busy: a fixed-speed formula such as Sakasegawa's called that a queue);
   past B, an exponential wait with rate `B (1 - rho) / slot_s` (slot_s at the full
   step), its mean scaled by Allen-Cunneen's `(1 + cv^2) / 2` (cv: the spread of the
   steps a request holds its slot; Poisson arrivals). At `rho >= 1` the queue never
   drains: every TTFT and end-to-end target is missed.
3. The backlog: the requests that wait now drain at `mu - lam` per pod; those arriving
   meanwhile (a share `f` of the window's) wait on top up to that drain time (taken as
   uniform).
4. TTFT of a prompt of P tokens: the slot wait, plus T (taken as added to every first
   token), plus its prefill steps, each carrying its chunk and the others' prefill.
   The TPOT target is judged on its distribution (`TpotTail`): the decode step plus the
   prompts of the requests arriving at its pod during the second half of its own
   prefill and while it decodes, at most G a step: a bigger budget gives lower TTFT
   and higher TPOT. The balancer sends each request to a pod holding the fewest, so
   an arrival joins a running request's pod only where every pod holds one: at
   `lam` times the chance that the fleet holds N - 1 others (Poisson at the fleet's
   `N lam` over the time a request holds its slot): on rag's four pods at 3% busy a
   twentieth of an even random split's rate (one request in a hundred decodes beside
   a prompt, not one in ten: the simulator measured none in three windows of four).
   End to end: TTFT plus `(O - 1)` x the mean TPOT (the step at load, plus one prefill
   chunk of the longest prompts (`min(G, P99)`) beyond the mean, spread over its O - 1
   tokens where an arrival lands beside its decode, at the same rate).
5. Attainment: one less the share that misses each stated target, summed (a union
   bound: conservative where misses overlap). p99s are read off the same tails.
6. KV: the peak rows (`R + 3 sqrt(R)`, at most B) times the mean KV tokens a row holds,
   over the pod's KV capacity in tokens (the window's KV tokens per step over its KV
   usage); None where the window cannot tell the capacity.

Speculative decoding (a candidate's k > 0): each decode row also verifies k draft
tokens, computed as prompt tokens are (the engine counts them so: k more prompt tokens a
row in the step model), and gains `g = (1 - a^(k+1)) / (1 - a)` tokens a step (speculation.py)
at the window's per-token acceptance `a` (`Window.acceptance`: measured under the k in
force, else the last measured; unknown: no gain). A request then holds its slot for
`(O - 1) / g` decode steps, and its TPOT is the step over g.

SLO classes (`class_loads`): where the policy states classes and the window carries each
class's own lengths (`ClassSignals`), each class's tails are judged with its own prompts
and answers against its own targets, and its attainment against its own objective; the
queue (arrivals, the step at load, the slot wait, the backlog, the prompts arriving
beside a decode) stays the totals', every class's requests together, since they share
the pods' slots and steps. A batch class's long prompts then lengthen the steps and the
slots held, as they do, without their prefill being judged against a chat class's TTFT.
The slot wait is the FIFO wait for every class, though the schedulers serve a higher
class first: conservative for the higher class (the one whose tight targets bind; its
real wait is shorter), and short by at most the age bound (`--class-max-wait-s`, 20 s
by default) for a lower one, whose targets are the loose ones (a batch class's
minutes). Modelling the priority queue would need each class's arrivals and holding
times apart, which a window's totals do not give per class; the conservative side is
the one that keeps the SLO. The overall attainment (`attainment`, the choice's
ranking) is the classes' weighted by their share of the window's judged requests.
Where the policy states no classes, or a class the window judged has no lengths of its
own (an older server), the totals are judged against the top-level targets, as
without classes.

Mode differences (dynamic batches wait to fill) are not modelled; `mode.py` chooses the
mode from the measured crossover map instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
from batchpilot_operator.policy.speculation import measured_acceptance, tokens_per_step
from batchpilot_operator.policy.step_model import StepModel, StepPoint, fit_for
from batchpilot_operator.policy.types import ReplicaState
from batchpilot_operator.policy.window import Lengths, Window, length_grid, mean_length
from batchpilot_operator.signals import ClassSignals, Signals
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import DEFAULT_CLASS, BatchingConfig

QUANTILE = 0.99
FIXED_POINT_ROUNDS = 30
BACKLOG_NODES = (0.125, 0.375, 0.625, 0.875)  # the uniform backlog wait's quadrature
MIN_KV_USAGE = 0.05  # below it the KV capacity read off the usage is noise


@dataclass(frozen=True)
class Candidate:
    max_batch_size: int
    batch_timeout_ms: float
    prefill_token_budget: int
    replicas: int
    num_speculative_tokens: int = 0

    @classmethod
    def in_force(cls, config: BatchingConfig, replicas: int) -> Candidate:
        """The config's own knobs on `replicas` pods."""
        return cls(
            config.max_batch_size, config.batch_timeout_ms, config.prefill_token_budget,
            replicas, config.num_speculative_tokens,
        )  # fmt: skip

    def config(self, base: BatchingConfig) -> BatchingConfig:
        return replace(
            base,
            max_batch_size=self.max_batch_size,
            batch_timeout_ms=self.batch_timeout_ms,
            prefill_token_budget=self.prefill_token_budget,
            num_speculative_tokens=self.num_speculative_tokens,
        )

    def describe(self) -> str:
        k = f", k {self.num_speculative_tokens}" if self.num_speculative_tokens else ""
        return (
            f"batch {self.max_batch_size}, timeout {self.batch_timeout_ms:g} ms, budget "
            f"{self.prefill_token_budget}{k} on {self.replicas} pod(s)"
        )


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    ttft_p99_s: float
    tpot_p99_s: float
    e2e_p99_s: float
    attainment: float
    utilisation: float  # rho: arrivals over what a pod carries at this config
    per_pod_rps: float  # mu
    step_s: float  # the step at this load
    kv_use: float | None  # predicted peak KV usage (share of the pool); None: unknown
    # each SLO class judged on its own lengths and targets (`class_loads`); empty where the
    # totals are judged against the top-level targets
    classes: tuple[ClassPrediction, ...] = ()

    @property
    def goodput_per_pod(self) -> float:
        """Requests per second per pod predicted to meet every target."""
        return self.per_pod_rps * min(1.0, self.utilisation) * self.attainment

    def p99(self, target: str) -> float:
        return {"ttft": self.ttft_p99_s, "tpot": self.tpot_p99_s, "e2e": self.e2e_p99_s}[target]

    def describe(self, slo: Slo) -> str:
        kv = "" if self.kv_use is None else f", KV {self.kv_use:.2f}"
        if self.classes:
            shown = "; ".join(c.describe() for c in self.classes)
            return f"{shown}; {self.utilisation:.0%} busy{kv}"
        shown = ", ".join(f"{name} p99 {_ms(self.p99(name))}" for name in slo.stated)
        return f"{shown}, attainment {self.attainment:.3f}, {self.utilisation:.0%} busy{kv}"


@dataclass(frozen=True)
class ClassPrediction:
    """One SLO class's predicted p99s of its stated targets and its attainment."""

    name: str
    p99s: dict[str, float]
    attainment: float

    def describe(self) -> str:
        shown = ", ".join(f"{name} p99 {_ms(p99)}" for name, p99 in self.p99s.items())
        return f"class {self.name}: {shown}, attainment {self.attainment:.3f}"


@dataclass(frozen=True)
class ClassLoad:
    """One SLO class as the predictor judges it: its stated targets (seconds), the
    attainment to meet, its share of the window's judged requests, and its own lengths."""

    name: str
    targets: dict[str, float]
    objective: float
    share: float
    prompts: Lengths
    outputs: Lengths


@dataclass(frozen=True)
class Judgement:
    """One SLO's predicted attainment against its objective: a class's (`name`), or the
    totals' against the top-level targets (None)."""

    name: str | None
    attainment: float
    objective: float
    targets: dict[str, float]  # its stated targets, seconds

    def needed(self, margin_share: float) -> float:
        """The attainment that meets the objective with the margin: the predicted misses
        at most `margin_share` of those the objective allows."""
        return 1 - margin_share * (1 - self.objective)

    def room(self, margin_share: float) -> float:
        """How far the attainment is past `needed`, in the misses the objective allows:
        the least room binds."""
        return (self.attainment - self.needed(margin_share)) / (1 - self.objective)


@dataclass(frozen=True)
class Scores:
    """A candidate's predictions for the choice, cheaply (no p99s): the overall attainment,
    each SLO's judgement, the utilisation and the busy rows."""

    attainment: float
    judgements: tuple[Judgement, ...]
    rho: float
    rows: float


@dataclass(frozen=True)
class _Queue:
    """One candidate's load: what the tails are computed from."""

    lam: float
    mu: float
    slots: int
    slot_s: float  # the time a request holds its slot with every slot held
    p_wait: float  # the chance that every slot is held (`_chance_to_wait`)
    wait_scale: float  # Allen-Cunneen: (1 + the slot time's squared CV) / 2
    backlog_s: float  # the backlog's drain time
    backlog_share: float  # the share of requests that meet it
    prompts: Lengths
    ttft_svc: tuple[float, ...]  # per prompt length
    outputs: Lengths
    tpot: tuple[float, ...]  # per output length, its mean (for end to end)
    tpot_tail: TpotTail
    step_s: float
    rows: float
    # each class's view of this queue: the same queue, its own lengths' service times
    classes: tuple[tuple[ClassLoad, _Queue], ...] = ()

    @property
    def rho(self) -> float:
        return self.lam / self.mu if self.mu > 0 else math.inf

    def wait_tail(self, t: float) -> float:
        """P(slot wait > t)."""
        if t < 0:
            return 1.0
        rho = self.rho
        if rho >= 1:
            return 1.0
        if rho <= 0:
            return 0.0
        rate = self.slots * (1 - rho) / (self.slot_s * self.wait_scale)
        return self.p_wait * math.exp(-rate * t)

    def tail(self, t: float) -> float:
        """P(slot wait, with the backlog's share, > t)."""
        f = self.backlog_share
        steady = self.wait_tail(t)
        if f <= 0:
            return steady
        behind = sum(self.wait_tail(t - u * self.backlog_s) for u in BACKLOG_NODES)
        return (1 - f) * steady + f * behind / len(BACKLOG_NODES)

    def miss_ttft(self, t: float) -> float:
        return sum(
            w * self.tail(t - svc) for (w, _), svc in zip(self.prompts, self.ttft_svc, strict=True)
        )

    def miss_tpot(self, t: float) -> float:
        return self.tpot_tail.miss(t)

    def miss_e2e(self, t: float) -> float:
        total = 0.0
        for (wp, _), svc in zip(self.prompts, self.ttft_svc, strict=True):
            for (wo, out), tpot in zip(self.outputs, self.tpot, strict=True):
                total += wp * wo * self.tail(t - svc - (out - 1) * tpot)
        return total

    def miss(self, target: str, t: float) -> float:
        return {"ttft": self.miss_ttft, "tpot": self.miss_tpot, "e2e": self.miss_e2e}[target](t)

    def met(self, targets: dict[str, float]) -> float:
        """The share meeting every target of `targets` (a union bound over the misses)."""
        return max(0.0, 1.0 - sum(self.miss(name, t) for name, t in targets.items()))

    def judgements(self, slo: Slo) -> tuple[Judgement, ...]:
        """Each class's attainment against its objective; the totals' where classes are
        not judged apart."""
        if self.classes:
            return tuple(
                Judgement(load.name, queue.met(load.targets), load.objective, load.targets)
                for load, queue in self.classes
            )
        return (Judgement(None, self.met(slo.stated), slo.attainment, slo.stated),)

    def attainment(self, slo: Slo) -> float:
        """The share predicted to meet its SLO: the classes' weighted by their shares."""
        if self.classes:
            return sum(load.share * queue.met(load.targets) for load, queue in self.classes)
        return self.met(slo.stated)

    def quantile(self, target: str) -> float:
        if target == "tpot":
            return self.tpot_tail.quantile(QUANTILE)
        if self.rho >= 1:
            return math.inf
        share = 1 - QUANTILE
        lo, hi = 0.0, 1.0
        while self.miss(target, hi) > share and hi < 1e6:
            hi *= 2
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.miss(target, mid) > share else (lo, mid)
        return hi


@dataclass(frozen=True)
class TpotTail:
    """The distribution of a request's time per output token (step 4's TPOT, in full).

    A request of O tokens decodes for n = O - 1 steps. Each step costs the decode part
    at this load (`decode_s`), plus the prompt tokens computed beside it: those of the
    requests arriving while it decodes or during the second half of its own prefill,
    k of them (Poisson, `arrivals_per_s` x (half its prefill + n decode steps), the
    rate the balancer sends to its pod while it runs: `_joins_its_pod`): of
    those landing during its prefill, the late ones are computed beside its first
    decode steps and the early ones mostly before them. Half is the share that matched
    the simulator's measured miss (rag: 0.028 predicted, 0.020 measured; chat: 0.005,
    0.021); the whole prefill doubled rag's, and stretching each prompt by those
    arriving while it is computed (a branching process's `1 / (1 - r)`) tripled it.
    Each arrives at a uniform moment of the decode and is computed at most `budget`
    tokens a step (so a prompt of P tokens adds `P (1 - P / 2Gn)` of them where
    `P <= Gn`, and `Gn / 2` past that). So its TPOT is
    `decode_s + per_prefill_s x min(budget, tokens / n)`: a short answer that meets one
    long prompt misses, which no mean shows.

    The arrays are over (its own prompt, output length, k, the last arrival's prompt):
    `tpot_s` is each cell's TPOT, `weight` its probability.
    """

    tpot_s: np.ndarray
    weight: np.ndarray

    @classmethod
    def of(
        cls,
        *,
        decode_s: float,
        per_prefill_s: float,
        budget: float,
        arrivals_per_s: float,
        outputs: Lengths,
        prompts: Lengths,
        tokens_per_step: float = 1.0,
        row_s: float = 0.0,
        rows: float = 0.0,
        others: float = 0.0,
        own_prompts: Lengths | None = None,
    ) -> TpotTail:
        """`row_s`: what each decode row beside it adds to a step beyond `decode_s`'s mean
        `rows` a step (0: the rows beside it are taken at the mean); `others`: the rows
        a running request finds beside it on average (time-averaged); `outputs` and
        `own_prompts` are the judged requests' (a class's), `prompts` the arrivals' beside
        them (every class's; `own_prompts` None: the same)."""
        prompt_weights = np.array([w for w, _ in prompts])
        prompt_tokens = np.array([p for _, p in prompts])
        mine = prompts if own_prompts is None else own_prompts
        # its own prompt on the first axis, the last arrival's on the fourth
        w_own = np.array([w for w, _ in mine])[:, None, None, None]
        own = np.array([p for _, p in mine])[:, None, None, None]
        w_prompt, prompt = prompt_weights[None, None, None, :], prompt_tokens[None, None, None, :]
        w_out = np.array([w for w, _ in outputs])[None, :, None, None]
        # its decode steps: a speculating row gains `tokens_per_step` tokens a step, but
        # a prompt computed beside one of its steps delays it once whatever that gains
        n = np.maximum(1.0, np.array([o for _, o in outputs]) - 1)[None, :, None, None]
        n = n / tokens_per_step
        mean_prompt = float(np.sum(w_prompt * prompt))
        # arrivals expected during the second half of its prefill and while it decodes
        m = arrivals_per_s * (own * per_prefill_s / 2 + n * decode_s)
        k_max = math.ceil(float(np.max(m)) + 6 * math.sqrt(float(np.max(m))) + 6)
        k = np.arange(k_max + 1, dtype=float)[None, None, :, None]
        log_fact = np.concatenate(([0.0], np.cumsum(np.log(np.arange(1, k_max + 1)))))
        with np.errstate(divide="ignore", invalid="ignore"):  # m = 0: where() takes k == 0
            log_pk = k * np.log(m) - m - log_fact[None, None, :, None]
        pk = np.where(m > 0, np.exp(log_pk), (k == 0).astype(float))

        # k arrivals: the last one's prompt at each point, the others at the mean
        def absorbed(p: np.ndarray | float) -> np.ndarray:
            room = budget * n
            return np.where(p <= room, p * (1 - p / (2 * room)), room / 2)

        tokens = np.where(k > 0, (k - 1) * absorbed(mean_prompt) + absorbed(prompt), 0.0)
        weight = w_own * w_out * pk * np.where(k > 0, w_prompt, 1.0 / prompt.shape[3])
        tpot = (decode_s + per_prefill_s * np.minimum(budget, tokens / n)) / tokens_per_step
        tpot, weight = (a.ravel() for a in np.broadcast_arrays(tpot, weight))
        if row_s > 0:
            # the rows beside it, Poisson: where a row costs much (speculation's verified
            # tokens) one more beside it moves its steps as much as a prompt does
            beside, chance = _poisson(others)
            extra = (1 + beside - rows) * row_s / tokens_per_step
            tpot = (tpot[:, None] + extra[None, :]).ravel()
            weight = (weight[:, None] * chance[None, :]).ravel()
        return cls(tpot, weight / max(float(np.sum(weight)), 1e-300))

    def miss(self, t: float) -> float:
        return float(np.sum(self.weight[self.tpot_s > t]))

    def quantile(self, q: float) -> float:
        order = np.argsort(self.tpot_s)
        cumulative = np.cumsum(self.weight[order])
        index = min(int(np.searchsorted(cumulative, q)), len(order) - 1)
        return float(self.tpot_s[order][index])


def _queue(window: Window, model: StepModel, c: Candidate) -> _Queue | None:
    lengths = lengths_of(window.signals)
    if lengths is None:
        return None
    prompts, outputs = lengths
    mean_p, mean_o = mean_length(prompts), mean_length(outputs)
    kv_row = mean_p + mean_o / 2
    budget, slots = max(1, c.prefill_token_budget), max(1, c.max_batch_size)
    k = c.num_speculative_tokens
    gain = tokens_per_step(window.acceptance or 0.0, k)  # tokens a decode step gives a row
    kv_row += k  # a verify row attends to its draft too
    chunks = [max(1, math.ceil(p / budget)) for _, p in prompts]
    mean_chunks = sum(w * n for (w, _), n in zip(prompts, chunks, strict=True))
    hold = mean_chunks + max(0.0, mean_o - 1) / gain  # steps a request holds its slot
    lam = window.forecast_rps / max(1, c.replicas)

    decoding = max(0.0, mean_o - 1) / hold  # the share of a held slot spent decoding

    def settle(full: bool) -> tuple[float, float, float]:
        """(step, decode rows, prompt tokens per step) at `lam`, or with every slot held."""
        step = _step_s(model, 1, 0, kv_row, k)
        rows = prefill = 0.0
        for _ in range(FIXED_POINT_ROUNDS):
            rate = slots / max(hold * step, 1e-12) if full else lam
            # per step the pod runs: Little's law counts its idle time too, when no
            # step runs (requests in the pod ~ Poisson(held), none a share e^-held)
            busy = 1.0 if full else -math.expm1(-rate * hold * step)
            rows = (
                slots * decoding
                if full
                else min(slots * decoding, rate * (hold - mean_chunks) * step / max(busy, 1e-12))
            )
            prefill = min(float(budget), rate * mean_p * step / max(busy, 1e-12))
            step = max(1e-9, _step_s(model, rows, prefill, rows * kv_row, k))
        return step, rows, prefill

    step, rows, prefill = settle(False)
    full_step, _, _ = settle(True)
    mu = slots / (hold * full_step)

    def held_step(held: int) -> float:
        """The step with `held` slots held (their decoding share as rows), beside the
        load's prompt tokens."""
        busy_rows = held * decoding
        return max(1e-9, _step_s(model, busy_rows, prefill, busy_rows * kv_row, k))

    p_wait = _chance_to_wait(lam, slots, hold, held_step)
    spare = mu - lam
    backlog = window.backlog / max(1, c.replicas)
    drain_s = backlog / spare if spare > 0 and backlog > 0 else 0.0
    share = min(1.0, drain_s / max(window.signals.window_s, 1e-9)) if drain_s > 0 else 0.0
    beside = lam * _joins_its_pod(lam * c.replicas * hold * step, c.replicas)
    # the longest prompts arriving beside a decode: every class's
    spike = max(0.0, min(float(budget), prompts[-1][1]) - prefill) * model.per_prefill_s

    def served(
        own_prompts: Lengths, own_outputs: Lengths
    ) -> tuple[tuple[float, ...], tuple[float, ...], TpotTail]:
        """The service of requests of these lengths (a class's, or the totals') at this
        load: TTFT past the slot wait per prompt length, the mean TPOT per output length
        and the TPOT's tail, beside every class's arrivals."""
        ttft_svc = tuple(
            c.batch_timeout_ms / 1000.0
            + n * _step_s(model, rows, min(float(budget), p / n + prefill), rows * kv_row, k)
            for _, p in own_prompts
            for n in [max(1, math.ceil(p / budget))]
        )
        # a spike delays a speculating row's step once: spread over its tokens, not its steps
        tpot = tuple(
            step / gain
            + spike * (1 - math.exp(-beside * max(1.0, o - 1) / gain * step)) / max(1.0, o - 1)
            for _, o in own_outputs
        )
        tail = TpotTail.of(
            # the draft tokens a row beside it verifies: zero without speculation, where the
            # rows' own cost is small next to the weights' (kept at the mean, as before k)
            row_s=model.per_prefill_s * k,
            rows=rows,
            others=min(slots * decoding, lam * (hold - mean_chunks) * step),
            decode_s=_step_s(model, rows, 0.0, rows * kv_row, k),
            per_prefill_s=model.per_prefill_s,
            budget=float(budget),
            arrivals_per_s=beside,
            outputs=own_outputs,
            prompts=prompts,
            own_prompts=own_prompts,
            tokens_per_step=gain,
        )
        return ttft_svc, tpot, tail

    held = [n + max(0.0, o - 1) / gain for (_, o) in outputs for n in chunks]
    weights = [wo * wp for (wo, _) in outputs for (wp, _) in prompts]
    cv2 = sum(w * (h - hold) ** 2 for w, h in zip(weights, held, strict=True)) / hold**2
    ttft_svc, tpot, tail = served(prompts, outputs)
    queue = _Queue(
        lam, mu, slots, hold * full_step, p_wait, (1 + cv2) / 2, drain_s, share, prompts, ttft_svc,
        outputs, tpot, tail, step, rows,
    )  # fmt: skip
    # each class: the same queue, its own requests' service (see the module docstring)
    classes = []
    for load in class_loads(window) or ():
        ttft_svc, tpot, tail = served(load.prompts, load.outputs)
        own = replace(queue, prompts=load.prompts, ttft_svc=ttft_svc, outputs=load.outputs,
                      tpot=tpot, tpot_tail=tail)  # fmt: skip
        classes.append((load, own))
    return replace(queue, classes=tuple(classes)) if classes else queue


def _chance_to_wait(lam: float, slots: int, hold: float, step_at: Callable[[int], float]) -> float:
    """P(every slot is held) in the birth-death chain of the requests a pod holds: arrivals
    at `lam`, and with n of its `slots` held each finishes after `hold` steps of
    `step_at(n)`, so the chain leaves n at `n / (hold x step_at(n))`: the steps lengthen
    with the slots held, as the pod's do. Past `slots` the chain is geometric at
    rho = lam / mu."""
    log_pi, logs = 0.0, [0.0]
    for n in range(1, slots + 1):
        log_pi += math.log(lam * hold * step_at(n) / n) if lam > 0 else -math.inf
        logs.append(log_pi)
    rho = lam * hold * step_at(slots) / slots
    if rho >= 1:
        return 1.0
    top = max(logs)
    weights = [math.exp(v - top) for v in logs]
    full = weights[slots] / (1 - rho)
    return full / (sum(weights[:slots]) + full)


def _joins_its_pod(held: float, pods: int) -> float:
    """The chance that an arrival joins a given running request's pod rather than another,
    over the even split's 1 / `pods`, behind a least-outstanding balancer: the fleet holds
    that request and `held` others (Poisson: each is held a while, the pods serving side
    by side), kept even across the pods; the arrival goes to a pod holding the fewest, so
    to that request's only where every pod holds one (at least `pods - 1` others), and
    then as often as to any other. One pod: always."""
    values, chances = _poisson(held)
    return float(np.sum(chances[values >= pods - 1]))


def _poisson(mean: float) -> tuple[np.ndarray, np.ndarray]:
    """Poisson(`mean`)'s values out to six deviations, and their chances."""
    top = math.ceil(mean + 6 * math.sqrt(mean) + 6)
    values = np.arange(top + 1, dtype=float)
    log_fact = np.concatenate(([0.0], np.cumsum(np.log(np.arange(1, top + 1)))))
    if mean <= 0:
        return values[:1], np.ones(1)
    chances = np.exp(values * math.log(mean) - mean - log_fact)
    return values, chances / chances.sum()


def _step_s(model: StepModel, rows: float, prefill: float, kv: float, k: int) -> float:
    """A step of `rows` decode rows beside `prefill` prompt tokens, each row verifying `k`
    draft tokens, which the engine counts as prompt tokens (`StepPlan.work`)."""
    return model.step_s(rows, prefill + rows * k, kv)


def class_loads(window: Window) -> tuple[ClassLoad, ...] | None:
    """Each stated class the window carries with lengths of its own (the default class,
    the top-level targets, first, as `Window.views`), its share of the window's judged
    requests; None where the policy states no classes, the window carries none, or a
    class it judged has no lengths (an older server's histograms carry no class): the
    totals are then judged against the top-level targets."""
    slo, seen = window.slo, window.signals.classes
    if not slo.classes or not seen:
        return None
    stated = [(DEFAULT_CLASS, slo.stated, slo.attainment),
              *((c.name, c.stated, c.attainment) for c in slo.classes)]  # fmt: skip
    found: list[tuple[str, dict[str, float], float, float, tuple[Lengths, Lengths]]] = []
    for name, targets, objective in stated:
        signals = seen.get(name)
        if signals is None:
            continue
        lengths = _class_lengths(signals)
        if lengths is None:
            if signals.slo_judged:
                return None
            continue
        found.append((name, targets, objective, signals.slo_judged or 0.0, lengths))
    judged = sum(n for _, _, _, n, _ in found)
    return tuple(
        ClassLoad(name, targets, objective, n / judged if judged > 0 else 1 / len(found),
                  prompts, outputs)
        for name, targets, objective, n, (prompts, outputs) in found
    ) or None  # fmt: skip


def _class_lengths(signals: ClassSignals) -> tuple[Lengths, Lengths] | None:
    """A class's prompt and output lengths over the quantile slices; None unless both are
    exported by class (the totals' fallbacks to means are the window's, not a class's)."""
    outputs = length_grid(signals.output_tokens_p10, signals.output_tokens_p50,
                          signals.output_tokens_p90, signals.output_tokens_p99)  # fmt: skip
    prompts = length_grid(signals.prompt_tokens_p10, signals.prompt_tokens_p50,
                          signals.prompt_tokens_p90, signals.prompt_tokens_p99)  # fmt: skip
    if outputs is None or prompts is None:
        return None
    return prompts, outputs


def lengths_of(signals: Signals) -> tuple[Lengths, Lengths] | None:
    """Prompt and output lengths over the window's quantile slices; prompts fall back to
    the window's mean prompt tokens computed per request, outputs to its mean tokens per
    request."""
    outputs = length_grid(signals.output_tokens_p10, signals.output_tokens_p50,
                          signals.output_tokens_p90, signals.output_tokens_p99)  # fmt: skip
    if outputs is None:
        mean = signals.mean_output_tokens
        if mean is None:
            return None
        outputs = ((1.0, mean),)
    prompts = length_grid(signals.prompt_tokens_p10, signals.prompt_tokens_p50,
                          signals.prompt_tokens_p90, signals.prompt_tokens_p99)  # fmt: skip
    if prompts is None:
        computed = signals.step_prefill_tokens
        mean = computed / signals.requests if computed and signals.requests > 0 else 0.0
        prompts = ((1.0, mean),)
    return prompts, outputs


def kv_capacity_tokens(signals: Signals) -> float | None:
    """A pod's KV pool in tokens: as the pods export it, else (an older server) the
    window's KV tokens per step over its KV usage, an underestimate where the fullest
    pod's peak stands beside the mean step's context."""
    if signals.kv_pool_tokens:
        return signals.kv_pool_tokens
    usage, kv, steps = signals.kv_usage, signals.step_kv_tokens, signals.steps
    if usage is None or usage < MIN_KV_USAGE or not kv or not steps:
        return None
    return (kv / steps) / usage


def scores_of(window: Window, model: StepModel, c: Candidate) -> Scores | None:
    """The candidate's predicted attainment (overall and each SLO's), utilisation and busy
    rows, cheaply (no p99s)."""
    queue = _queue(window, model, c)
    if queue is None:
        return None
    slo = window.slo
    return Scores(queue.attainment(slo), queue.judgements(slo), queue.rho, queue.rows)


def kv_use(window: Window, c: Candidate, rows: float) -> float | None:
    capacity = kv_capacity_tokens(window.signals)
    lengths = lengths_of(window.signals)
    if capacity is None or lengths is None:
        return None
    prompts, outputs = lengths
    kv_row = mean_length(prompts) + mean_length(outputs) / 2
    peak = min(float(c.max_batch_size), rows + 3 * math.sqrt(max(rows, 0.0)))
    return peak * kv_row / capacity


def predict(window: Window, model: StepModel, c: Candidate) -> Prediction | None:
    """The candidate's full prediction; None where the window has no lengths to size by."""
    queue = _queue(window, model, c)
    if queue is None:
        return None
    return Prediction(
        candidate=c,
        ttft_p99_s=queue.quantile("ttft"),
        tpot_p99_s=queue.quantile("tpot"),
        e2e_p99_s=queue.quantile("e2e"),
        attainment=queue.attainment(window.slo),
        utilisation=queue.rho,
        per_pod_rps=queue.mu,
        step_s=queue.step_s,
        kv_use=kv_use(window, c, queue.rows),
        classes=tuple(
            ClassPrediction(
                load.name, {name: q.quantile(name) for name in load.targets}, q.met(load.targets)
            )
            for load, q in queue.classes
        ),
    )


def predict_config(
    signals: Signals,
    config: BatchingConfig,
    replicas: int,
    slo: Slo,
    points: tuple[StepPoint, ...],
) -> Prediction | None:
    """What the rule predicts for `config` on `replicas` pods at this window's demand,
    with the step model fitted through `points` (the rule's memory: `PolicyMemory.points`)
    at the window's fleet size; None without a trusted fit (the rule steps by its
    fallback until then) or lengths. For comparing predicted
    against measured per window (bench/tuner.py)."""
    model = fit_for(points, signals.pods)
    if model is None or not model.trusted:
        return None
    window = replace(
        Window.of(signals, slo, None, None, ReplicaState()),
        acceptance=measured_acceptance(signals, config.num_speculative_tokens),
    )
    return predict(window, model, Candidate.in_force(config, replicas))


def _ms(seconds: float) -> str:
    return "never" if math.isinf(seconds) else f"{seconds * 1000:.0f} ms"
