"""`batchpilot operator`: run the Kopf operator for BatchingPolicy resources."""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
from urllib.parse import urlparse

import kopf
from kopf._core.engines.activities import ActivityError  # kopf.run raises it; not exported

DEFAULT_LIVENESS_PORT = 8080
DEFAULT_METRICS_PORT = 8081
NAMESPACE_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
# The modules whose import registers Kopf handlers: `handlers` reconciles each
# policy's objects; `autotune` starts and stops each policy's tuning task.
HANDLER_MODULES: tuple[str, ...] = ("batchpilot_operator.handlers", "batchpilot_operator.autotune")


def load_handlers() -> None:
    """Import every handler module so that its decorators register on Kopf's default registry."""
    for module in HANDLER_MODULES:
        importlib.import_module(module)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchpilot operator",
        description="Reconcile BatchingPolicy resources and tune their servers' batching.",
    )
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--namespace", "-n", action="append", dest="namespaces", metavar="NS",
        help="serve this namespace (repeat for several)",
    )
    scope.add_argument(
        "--all-namespaces", "-A", action="store_true", help="serve the whole cluster"
    )
    parser.add_argument(
        "--prometheus-url", default="",
        help="Prometheus for policies that set no autotune.prometheusUrl "
        "(empty: scrape the pods' /metrics directly)",
    )
    parser.add_argument(
        "--liveness-port", type=int, default=DEFAULT_LIVENESS_PORT,
        help=f"port of the /healthz liveness endpoint (default {DEFAULT_LIVENESS_PORT}; 0: off)",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
        help="port of /metrics with each policy's SLO and KV watermark for Prometheus "
        f"(default {DEFAULT_METRICS_PORT}; 0: off)",
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    return parser


def _check_url(parser: argparse.ArgumentParser, url: str) -> None:
    parsed = urlparse(url)
    if url and (parsed.scheme not in ("http", "https") or not parsed.netloc):
        parser.error(
            f"--prometheus-url must be an http(s) URL like http://prometheus:9090, got {url!r}"
        )


def _check_namespaces(parser: argparse.ArgumentParser, namespaces: list[str] | None) -> None:
    for namespace in namespaces or ():
        if not NAMESPACE_RE.fullmatch(namespace):
            parser.error(
                f"--namespace {namespace!r} is not a namespace name (lowercase letters, digits "
                "and '-', at most 63); patterns are not supported: the operator does not list "
                "namespaces"
            )


def _check_ports(parser: argparse.ArgumentParser, liveness: int, metrics: int) -> None:
    for flag, port in (("--liveness-port", liveness), ("--metrics-port", metrics)):
        if not 0 <= port <= 65535:
            parser.error(f"{flag} must be 0..65535, got {port}")
    if liveness and liveness == metrics:
        parser.error(
            f"--liveness-port and --metrics-port are both {liveness}: "
            "they are two servers and need two ports"
        )


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_namespaces(parser, args.namespaces)
    _check_url(parser, args.prometheus_url)
    _check_ports(parser, args.liveness_port, args.metrics_port)
    kopf.configure(
        verbose=args.verbose, log_format=kopf.LogFormat.JSON, log_refkey="object"
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    load_handlers()
    liveness = (
        f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    )
    try:
        kopf.run(
            clusterwide=args.all_namespaces,
            namespaces=args.namespaces or (),
            standalone=True,  # one replica; no peering objects (and no RBAC for them)
            liveness_endpoint=liveness,
            memo=kopf.Memo(prometheus_url=args.prometheus_url, metrics_port=args.metrics_port),
        )
    except ActivityError as exc:  # a startup handler failed for good, e.g. a taken port
        causes = [str(o.exception) for o in exc.outcomes.values() if o.exception is not None]
        print(f"batchpilot operator: error: {'; '.join(causes) or exc}", file=sys.stderr)
        return 1
    return 0
