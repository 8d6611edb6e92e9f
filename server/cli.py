"""`batchpilot` command line: one entry point, subcommands import lazily.

The operator's subcommands never import torch.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> module exposing `main(argv: list[str]) -> int`
SUBCOMMANDS = {
    "serve": ("batchpilot_server.serve", "run the inference server"),
    "loadgen": ("batchpilot_tools.loadgen", "drive load against servers"),
    "operator": ("batchpilot_operator.main", "run the Kubernetes operator"),
    "tune": ("batchpilot_operator.tune_local", "tune local servers"),
    "demo": ("batchpilot_tools.demo.cli", "local demo: servers, load, tuner"),
}


def usage() -> str:
    lines = ["usage: batchpilot <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"batchpilot: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
