"""Fuzz: the HTTP API fuzzed from its own /openapi.json by schemathesis, for minutes.

The same fuzzing as tests/integration/test_openapi_fuzz.py (the real app and engine,
tiny model, max_tokens limit 4, an admin token), with many more cases and new ones
every run. For every operation of the document, positive cases (that fit it) and
negative ones (that break it); each answer must be free of 5xx, of a documented
status, content type and schema, in the error shape when it is a 4xx, and invalid
data must be refused. Hypothesis stops an (operation, mode) at its first failing case
and shrinks it. Afterwards /healthz must be ok.

    python bench/fuzz.py                  # ~3 minutes
    python bench/fuzz.py --examples 200   # per operation and mode
    python bench/fuzz.py --quick          # ~15 s, for a smoke run

Prints a table and a final JSON line; writes its section of docs/reliability.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from schemathesis import GenerationMode
from sections import replace_section

ROOT = Path(__file__).resolve().parent.parent
# appended, not prepended: the repository's `operator` folder would shadow the stdlib's
sys.path.append(str(ROOT))
from tests.support.openapi_fuzz import Fuzzer, Tally  # noqa: E402
from tests.support.servers import serve_on_thread  # noqa: E402

DOC = ROOT / "docs" / "reliability.md"
TOKEN = "fuzz-token"
MAX_TOKENS = 4
EXAMPLES = 2000
QUICK_EXAMPLES = 100
STATUS_CLASSES = ("2xx", "4xx", "5xx")
INTRO = (
    "schemathesis reads the server's own `/openapi.json` and sends, to every operation, "
    "requests that fit it (positive) and requests that break it (negative: wrong types, "
    "values out of range, missing or unknown fields), to the real app and engine (tiny "
    "model, `max_tokens` limit 4, an admin token so `PUT /admin/batching` is fuzzed too). "
    "A failure: a 5xx, an undocumented status or content type, a 2xx body off its schema, "
    "a 4xx not in the error shape, a stream that is not chunk or error events ending "
    "`[DONE]`, or invalid data accepted. Operations without parameters or body have no "
    "negative cases; `GET /openapi.json` is the document itself, which schemathesis leaves "
    "out. Every request carries the admin token (the 401 and 403 answers are "
    "tests/integration/test_server_admin.py's), so a negative case whose only fault is its "
    "`Authorization` header is sent valid and may get a 2xx. A positive case may get a 4xx "
    "the document cannot show: `max_tokens` above the server's limit, token ids past the "
    "vocabulary, a `model` other than the served name, or `5.0` where an integer is due "
    "(JSON Schema counts it an integer; the server's strict parsing refuses it). "
    "`make test` runs the same with 40 cases per operation and mode "
    "(`tests/integration/test_openapi_fuzz.py`). `python bench/fuzz.py` (~3 min; "
    "`--examples`, `--quick`)."
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=EXAMPLES, help="per operation and mode")
    p.add_argument("--quick", action="store_true", help=f"--examples {QUICK_EXAMPLES}")
    p.add_argument("--no-doc", action="store_true", help="do not write docs/reliability.md")
    args = p.parse_args(argv)
    if args.quick:
        args.examples = QUICK_EXAMPLES
    return args


def fuzz_all(fuzzer: Fuzzer, examples: int) -> dict[tuple[str, str], Tally]:
    """Every operation in both modes; stops once the server is unhealthy, since every
    answer after that would be the same 503."""
    tallies = {}
    for operation in fuzzer.operations():
        for mode in GenerationMode:
            tally = fuzzer.fuzz(operation, mode, examples=examples)
            tallies[(operation.label, mode.value)] = tally
            progress = f"{tally.cases} cases {dict(tally.statuses)} {len(tally.failures)} failed"
            print(f"{operation.label} {mode.value}: {progress}", flush=True)
            if not fuzzer.healthy():
                return tallies
    return tallies


def reproductions(tallies: dict[tuple[str, str], Tally]) -> str:
    """Each failure's check and the shrunk case that shows it, as schemathesis wrote them."""
    lines = []
    for (label, mode), tally in tallies.items():
        for report in tally.failures:
            lines_ = [line.strip() for line in report.splitlines()]
            check = next((line[2:] for line in lines_ if line.startswith("- ")), "")
            curl = next((line for line in lines_ if line.startswith("curl ")), "")
            lines.append(f"- `{label}` {mode}: {check}\n\n      {curl}")
    return "\n".join(lines)


def table(tallies: dict[tuple[str, str], Tally]) -> str:
    lines = [
        f"| operation | mode | cases | {' | '.join(STATUS_CLASSES)} | failures |",
        "|---|---|---:|" + "---:|" * len(STATUS_CLASSES) + "---:|",
    ]
    for (label, mode), tally in tallies.items():
        counts = " | ".join(str(tally.statuses[c]) for c in STATUS_CLASSES)
        cases = str(tally.cases) if tally.cases else "- (nothing to break)"
        lines.append(f"| `{label}` | {mode} | {cases} | {counts} | {len(tally.failures)} |")
    return "\n".join(lines)


def summary(tallies: dict[tuple[str, str], Tally], healthy: bool, seconds: float) -> str:
    cases = sum(t.cases for t in tallies.values())
    failures = sum(len(t.failures) for t in tallies.values())
    return (
        f"{cases} cases in {seconds:.0f} s, {failures} failures; "
        f"`/healthz` afterwards: {'ok' if healthy else 'NOT ok'}."
    )


def result(
    tallies: dict[tuple[str, str], Tally], healthy: bool, seconds: float, examples: int
) -> dict[str, Any]:
    failures = [f"{label} {mode}: {text}" for (label, mode), t in tallies.items()
                for text in t.failures]  # fmt: skip
    return {
        "examples_per_operation_and_mode": examples,
        "duration_s": round(seconds, 1),
        "cases": sum(t.cases for t in tallies.values()),
        "statuses": {c: sum(t.statuses[c] for t in tallies.values()) for c in STATUS_CLASSES},
        "operations": len({label for label, _ in tallies}),
        "failures": len(failures),
        "healthy_after": healthy,
        "passed": healthy and not failures,
        "failure_reports": failures,
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with serve_on_thread(max_tokens=MAX_TOKENS, admin_token=TOKEN) as url:
        fuzzer = Fuzzer.connect(url, token=TOKEN)
        tallies = fuzz_all(fuzzer, args.examples)
        healthy = fuzzer.healthy()
    seconds = time.monotonic() - started
    text = f"{table(tallies)}\n\n{summary(tallies, healthy, seconds)}"
    if failures := reproductions(tallies):
        text += f"\n\nFailures, each with its shrunk case:\n\n{failures}"
    print(text)
    outcome = result(tallies, healthy, seconds, args.examples)
    for report in outcome["failure_reports"]:
        print(f"\n{report}", file=sys.stderr)
    if not args.no_doc:
        section = "## The HTTP API fuzzed from its own OpenAPI document (`bench/fuzz.py`)\n\n"
        replace_section(DOC, "openapi-fuzz", f"{section}{INTRO}\n\n{text}")
    print(json.dumps(outcome))
    return 0 if outcome["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
