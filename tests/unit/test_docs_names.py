"""What the README and docs/ name exists: every `--flag` is a flag a real parser defines,
every `batchpilot_*` metric is in the name modules, every CRD field path is in the schema."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from batchpilot_tools import docs_gen

from tests.support import ROOT

PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
# Flags of the other tools the docs show commands of, each with its tool.
EXTERNAL_FLAGS = {
    "--build-arg": "docker build",
    "--index-url": "pip install",
    "--name": "kind load docker-image",
    "--recursive": "kubectl explain",
    "--help": "every command",
    "--from-literal": "kubectl create secret",
    "--allow-requantize": "llama-quantize",
    "--outtype": "llama.cpp's convert_hf_to_gguf.py",
    "--max-num-seqs": "vLLM's api_server",
    **dict.fromkeys(
        ("--model_args", "--tasks", "--include", "--batch", "--log", "--output"),
        "lm_eval run (its flags have underscores: --include_path, --batch_size, ...)",
    ),
    **dict.fromkeys(
        ("--endpoint-type", "--streaming", "--tokenizer", "--isl", "--osl", "--request-count",
         "--use-server-token-count", "--output-artifact-dir", "--ui", "--extra-inputs"),
        "aiperf profile",
    ),
}  # fmt: skip
# batchpilot_* words that are not metrics, each with what it is.
NOT_METRICS = {"batchpilot_facts": "the lm-eval task tests/data/lm_eval ships"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
METRIC = re.compile(r"(?<![\w])batchpilot_[a-z0-9_]+")
PACKAGES = {"batchpilot_server", "batchpilot_operator", "batchpilot_tools"}
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
SECTIONS = ("autoscale", "server", "batching", "slo", "autotune")
FIELD_PATH = re.compile(
    rf"\.?(?:(?:spec|status)\.[\w.{{}},\[\]]+|(?:{'|'.join(SECTIONS)})\.[\w.{{}},\[\]]+)"
)
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json")


def pages_text() -> Iterator[tuple[Path, str]]:
    for page in PAGES:
        yield page, page.read_text()


def bench_flags() -> set[str]:
    """The benchmarks' flags, read from their add_argument calls (bench/ is not a package)."""
    flags = set()
    for script in (ROOT / "bench").glob("*.py"):
        for call in re.finditer(r"add_argument\(\s*((?:\"[^\"]*\",\s*)+)", script.read_text()):
            flags |= set(re.findall(r"\"(--[a-z][a-z0-9-]*)\"", call.group(1)))
    return flags


@pytest.fixture(scope="module")
def batchpilot_flags() -> dict[str, set[str]]:
    return {
        name: {s for a in docs_gen.flag_rows(p) for s in a.option_strings}
        for name, p in docs_gen.subcommand_parsers().items()
    }


def test_every_flag_named_in_the_docs_is_a_real_flag(
    batchpilot_flags: dict[str, set[str]],
) -> None:
    known = set().union(*batchpilot_flags.values(), bench_flags(), EXTERNAL_FLAGS)
    unknown = {
        (page.relative_to(ROOT).as_posix(), flag)
        for page, text in pages_text()
        for flag in FLAG.findall(text)
        if flag not in known
    }
    assert unknown == set(), "flags that no parser defines"


def test_the_server_page_names_only_serve_and_loadgen_flags(
    batchpilot_flags: dict[str, set[str]],
) -> None:
    text = (ROOT / "docs" / "server.md").read_text()
    allowed = batchpilot_flags["serve"] | batchpilot_flags["loadgen"]
    assert {f for f in FLAG.findall(text) if f not in allowed} == set()
    # the synopsis names the flags it once left out
    assert "--dynamic-execution" in text and "--max-wait-ms" in text


def test_a_made_up_flag_is_caught(batchpilot_flags: dict[str, set[str]]) -> None:
    assert "--max-batch-sizes" not in set().union(*batchpilot_flags.values())
    assert FLAG.findall("run `batchpilot serve --max-batch-sizes 8`") == ["--max-batch-sizes"]


def metric_names() -> set[str]:
    names = set()
    for metric in docs_gen.metrics():
        names.add(metric.name)
        if metric.type == "histogram":
            names |= {metric.name + suffix for suffix in HISTOGRAM_SERIES}
        if metric.type == "counter":  # the family name recording rules and PromQL may use
            names.add(metric.name.removesuffix("_total"))
    return names


def test_every_metric_named_in_the_docs_exists() -> None:
    known = metric_names() | PACKAGES | set(NOT_METRICS)
    unknown = {
        (page.relative_to(ROOT).as_posix(), name)
        for page, text in pages_text()
        for name in METRIC.findall(text)
        if name not in known
    }
    assert unknown == set(), "metric names that neither name module defines"


def schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / docs_gen.CRD_PATH).read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def expand(path: str) -> list[str]:
    """`a.{b,c}` -> `a.b`, `a.c`."""
    match = re.search(r"\{([^}]*)\}", path)
    if not match:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [p for part in match.group(1).split(",") for p in expand(head + part.strip() + tail)]


def resolves(root: dict[str, Any], path: str) -> bool:
    node = root
    for part in path.replace("[]", "").split("."):
        node = node.get("items", node)
        properties = node.get("properties", {})
        if part not in properties:
            return False
        node = properties[part]
    return True


def field_paths(text: str) -> Iterator[str]:
    for span in CODE_SPAN.findall(text):
        if FIELD_PATH.fullmatch(span) and not span.endswith(FILE_SUFFIXES):
            yield from expand(span.lstrip("."))


def field_exists(root: dict[str, Any], path: str) -> bool:
    if path.startswith(("spec.", "status.")):
        return resolves(root, path)
    return resolves(root["properties"]["spec"], path)  # `server.model`: under spec


def test_every_crd_field_named_in_the_docs_is_in_the_schema() -> None:
    root = schema()
    named = {
        (page.relative_to(ROOT).as_posix(), path)
        for page, text in pages_text()
        for path in field_paths(text)
    }
    assert len(named) > 50  # the check reads the pages it means to
    assert {(page, path) for page, path in named if not field_exists(root, path)} == set()


def test_a_made_up_field_is_caught() -> None:
    root = schema()
    assert list(field_paths("set `autoscale.minReplica` and `server.model.path`")) == [
        "autoscale.minReplica",
        "server.model.path",
    ]
    assert not field_exists(root, "autoscale.minReplica")
    assert field_exists(root, "server.model.path")
    assert field_exists(root, "status.conditions[].lastTransitionTime")
    assert expand("batching.maxBatchSize.{initial,min}") == [
        "batching.maxBatchSize.initial",
        "batching.maxBatchSize.min",
    ]


LINK = re.compile(r"\]\(([^)#\s]*)(#[^)\s]*)?\)")
HEADING = re.compile(r"^#+ (.*)$", re.MULTILINE)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lowercased, punctuation dropped, spaces to -."""
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in HEADING.findall(page.read_text())
    }


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for page, text in pages_text():
        for target, anchor in LINK.findall(text):
            if target.startswith(("http://", "https://")):
                continue
            path = page.parent / target if target else page
            if not path.exists():
                broken.append((page.name, target))
            elif anchor and path.suffix == ".md" and anchor[1:] not in anchors(path):
                broken.append((page.name, target + anchor))
    assert broken == []
