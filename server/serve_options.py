"""`batchpilot serve`'s command line: its flags, and what each turns into (the engine's
options, the batching config, secrets, connection limits), a UsageError where one cannot
be used."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from batchpilot_server.admin_token import TokenFile, TokenFileError
from batchpilot_server.batching_config import (
    CLASS_NAME_PATTERN,
    DEFAULT_CLASS,
    MODES,
    BatchingConfig,
    ConfigError,
)
from batchpilot_server.chat_template import ChatTemplate, ChatTemplateError
from batchpilot_server.cpu_quota import default_threads
from batchpilot_server.engine_api import (
    ATTENTION_BACKENDS,
    CLASS_MAX_WAIT_S,
    DTYPES,
    EXECUTIONS,
    LOWER_CLASS_PREFILL_TOKENS,
    QUANTIZATIONS,
    EngineOptions,
)
from batchpilot_server.http.connections import ConnectionLimits
from batchpilot_server.http.metrics import METRICS_COMPATS
from batchpilot_server.http.protocol import Limits
from batchpilot_server.model_presets import PRESET_NAMES

log = logging.getLogger("batchpilot.serve")

# what `batchpilot serve --help` says the command does
DESCRIPTION = "`batchpilot serve`: run one inference server until SIGTERM, then drain and exit 0."

# Share of free GPU memory the KV pool takes when --kv-cache-mb is not given.
GPU_MEMORY_FRACTION = 0.8


# Once the shutdown grace runs out, how long the error answers may take to be
# written, and then how long connections that do not take them stay open.
ANSWER_MARGIN_S = 1.0


# The process exits within the grace plus this: both answer margins, then the model
# step in progress and the interpreter's exit (a step longer than that, such as a
# long prefill on a CPU, adds what it lasts beyond).
EXIT_MARGIN_S = 2 * ANSWER_MARGIN_S + 1.0


class UsageError(Exception):
    """A flag or file the user gave cannot be used; exit 2 with this message."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="batchpilot serve", description=DESCRIPTION)
    defaults = BatchingConfig()
    p.add_argument(
        "--model",
        default="tiny",
        metavar="NAME|DIR|FILE.gguf",
        help=f"a preset ({', '.join(PRESET_NAMES)}), a Hugging Face model directory or a "
        "GGUF file (default: tiny)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights' dtype; auto: bfloat16 on a GPU, and on a CPU with native bfloat16 "
        "(AVX512-BF16/AMX) for a checkpoint (within the quality bound of "
        "docs/benchmarks.md), else float32 (default: auto)",
    )
    p.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATIONS,
        help="weight-only, on the CPU. int8: a scale per output channel for every "
        "projection and the LM head (with --dtype auto the activations are bfloat16); "
        "int4: the decoder's projections as 4-bit codes with a scale and a minimum per "
        "32 inputs (GGUF Q4_1's block: a Q4_1 file's weights exactly), bfloat16 "
        "activations, fastest at small batches (default: none)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="context in tokens, prompt + output (default: the model's)",
    )
    p.add_argument(
        "--served-model-name",
        help="the model's name in the API and the metrics (default: the preset's name, "
        "the directory's basename or the GGUF file's stem)",
    )
    p.add_argument(
        "--mode",
        default="continuous",
        choices=MODES,
        help="continuous: sequences join and leave the batch every step; dynamic: a batch "
        "fires at --max-batch-size requests or once the oldest waited --batch-timeout-ms, "
        "then runs as one unit; static: a batch fires only at --max-batch-size requests "
        "(--batch-timeout-ms has no effect; see --max-wait-ms) (default: continuous)",
    )
    p.add_argument(
        "--dynamic-execution",
        default="ragged",
        choices=EXECUTIONS,
        help="static and dynamic modes: ragged: a finished member of a batch computes "
        "nothing more and holds its slot until the batch ends; padded: it keeps decoding, "
        "its outputs discarded, as classic padded batchers run (default: ragged)",
    )
    p.add_argument(
        "--max-wait-ms",
        type=float,
        help="static mode's safety valve: a partial batch fires once its oldest request "
        "waited this long (default: off, a batch waits until it is full)",
    )
    p.add_argument(
        "--class-max-wait-s",
        type=float,
        default=CLASS_MAX_WAIT_S,
        help="SLO classes: a request that arrived this long ago is served as if in the "
        f"highest class, so no class starves (default: {CLASS_MAX_WAIT_S:g})",
    )
    p.add_argument(
        "--lower-class-prefill-tokens",
        type=int,
        default=LOWER_CLASS_PREFILL_TOKENS,
        help="SLO classes, continuous mode: the most prompt tokens lower classes compute "
        "in a step that decodes a higher class's requests (an aged request is not held "
        "to it), so their prompts cost the higher class's TPOT little "
        f"(default: {LOWER_CLASS_PREFILL_TOKENS})",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=defaults.max_batch_size,
        help="most sequences in one batch or step (live: PUT /admin/batching)",
    )
    p.add_argument(
        "--batch-timeout-ms",
        type=float,
        default=defaults.batch_timeout_ms,
        help="dynamic: how long a partial batch waits for more; continuous: how long an "
        "idle engine waits before its first step (live)",
    )
    p.add_argument(
        "--max-queue-size",
        type=int,
        default=defaults.max_queue_size,
        help="waiting requests beyond which new ones get 429 (live)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where the model runs (auto: cuda when available)",
    )
    p.add_argument(
        "--kv-cache-mb",
        type=float,
        help=f"KV cache size (default: {EngineOptions.kv_cache_mb:g} on CPU, "
        f"{GPU_MEMORY_FRACTION * 100:.0f}%% of free memory on a GPU)",
    )
    p.add_argument(
        "--admin-token-file",
        type=Path,
        help="enables PUT /admin/batching; read again whenever the file changes",
    )
    keys = p.add_mutually_exclusive_group()
    keys.add_argument(
        "--api-key",
        help=f"the OpenAI routes (/v1/*, /tokenize, /detokenize) then need 'Authorization: "
        f"Bearer KEY'; probes and /metrics stay open (default: ${API_KEY_ENV}, else none). "
        "A flag shows in the process list: prefer --api-key-file",
    )
    keys.add_argument(
        "--api-key-file",
        type=Path,
        help="as --api-key, the key read from this file (again whenever it changes)",
    )
    p.add_argument(
        "--api-key-class",
        action="append",
        default=[],
        metavar="CLASS=KEY_FILE",
        help="a tenant's API key, read from KEY_FILE (again whenever it changes), bound to "
        "the SLO class CLASS: its requests are judged in CLASS whatever header or priority "
        "they send. Repeat for more tenants; any bound key also opens the OpenAI routes",
    )
    p.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="a jinja2 chat template that replaces the model's (a model without one can then chat)",
    )
    p.add_argument(
        "--metrics-compat",
        default="vllm",
        choices=METRICS_COMPATS,
        help="vllm: /metrics also exports vLLM's names (vllm:num_requests_waiting, ...) "
        "with label model_name, for vLLM dashboards, KEDA triggers and the Gateway API "
        "Inference Extension's endpoint picker; none: batchpilot's names only (default: vllm)",
    )
    p.add_argument(
        "--config-file",
        type=Path,
        help="JSON batching config; its values win over the batching flags",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: the CPUs the container may use: its cgroup "
        "CPU quota, capped by its CPU affinity)",
    )
    p.add_argument(
        "--attention",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="decode attention: native C kernel (CPU), torch, or auto: native where it "
        "builds, else torch (default: auto)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=BatchingConfig.num_speculative_tokens,
        help="continuous mode: draft tokens (n-gram prompt lookup over each request's own "
        "tokens) verified per decode row and step; 0 turns speculative decoding off. "
        "The initial value: PUT /admin/batching changes it live "
        f"(default: {BatchingConfig.num_speculative_tokens})",
    )
    p.add_argument(
        "--prefill-token-budget",
        type=int,
        default=BatchingConfig.prefill_token_budget,
        help="continuous mode: prompt tokens computed per step; a longer prompt is "
        "prefilled in chunks while running requests keep decoding. Lower: steadier "
        "inter-token latency for running requests, later first token for long prompts. "
        "The initial value: PUT /admin/batching changes it live "
        f"(default: {BatchingConfig.prefill_token_budget})",
    )
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="compute every prompt in full instead of reusing the K/V of the longest "
        "prefix earlier requests computed (prefix caching needs the native decode "
        "attention; it is off with --attention torch)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds a preset's random weights (tiny), not sampling: a request's `seed` does that",
    )
    p.add_argument(
        "--queue-timeout-s",
        type=float,
        default=Limits.queue_timeout_s,
        help="a request waiting longer unscheduled gets 504",
    )
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM, how long in-flight requests may take to finish; then each "
        "gets a 503 (a stream that has begun, a final error event and [DONE]) and the "
        f"process exits within {EXIT_MARGIN_S:g} s more (default: 30)",
    )
    connections = ConnectionLimits()
    p.add_argument(
        "--http-read-timeout-s",
        type=float,
        default=connections.read_timeout_s,
        help="a request's headers and body must arrive within this of its first byte: "
        "else the connection is closed (a late body gets 408 first)",
    )
    p.add_argument(
        "--http-keepalive-timeout-s",
        type=float,
        default=connections.keepalive_timeout_s,
        help="an idle connection (no request in progress) is closed after this",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=connections.max_connections,
        help="open connections at most; beyond it the longest idle one is closed, or the "
        "new one when every connection has a request in progress",
    )
    return p


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    try:
        limits = ConnectionLimits(
            read_timeout_s=args.http_read_timeout_s,
            keepalive_timeout_s=args.http_keepalive_timeout_s,
            max_connections=args.max_connections,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if warning := limits.fd_warning():
        log.warning("%s", warning)
    return limits


def batching_config(args: argparse.Namespace) -> BatchingConfig:
    try:
        flags = BatchingConfig(
            max_batch_size=args.max_batch_size,
            batch_timeout_ms=args.batch_timeout_ms,
            max_queue_size=args.max_queue_size,
            prefill_token_budget=args.prefill_token_budget,
            num_speculative_tokens=args.num_speculative_tokens,
        )
        if args.config_file is None:
            return flags
        return BatchingConfig.from_file(args.config_file, base=flags)
    except (ConfigError, TypeError) as exc:
        raise UsageError(str(exc)) from exc


def admin_token(path: Path | None) -> TokenFile | None:
    if path is None:
        return None
    try:
        return TokenFile(path)
    except TokenFileError as exc:
        raise UsageError(str(exc)) from exc


API_KEY_ENV = "BATCHPILOT_API_KEY"


def api_key(args: argparse.Namespace) -> str | TokenFile | None:
    """--api-key, --api-key-file, else $BATCHPILOT_API_KEY; None: the API is open."""
    if args.api_key_file is not None:
        try:
            return TokenFile(args.api_key_file, what="API key")
        except TokenFileError as exc:
            raise UsageError(str(exc)) from exc
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        source = "--api-key" if args.api_key is not None else f"${API_KEY_ENV}"
        raise UsageError(f"{source} is empty; give a key or leave it unset")
    return key.strip() if key is not None else None


def class_keys(args: argparse.Namespace, free_key: str | TokenFile | None) -> list[ClassKeyFile]:
    """--api-key-class CLASS=KEY_FILE, each read now; no key may open two classes (the
    first match would win, and a tenant could escape its class)."""
    out: list[ClassKeyFile] = []
    for given in args.api_key_class:
        name, sep, path = given.partition("=")
        if not sep or not path:
            raise UsageError(f"--api-key-class {given!r}: give CLASS=KEY_FILE")
        if name != DEFAULT_CLASS and not CLASS_NAME_PATTERN.fullmatch(name):
            raise UsageError(f"--api-key-class {given!r}: {name!r} is no SLO class name")
        try:
            out.append(ClassKeyFile(name, TokenFile(Path(path), what=f"API key of class {name}")))
        except TokenFileError as exc:
            raise UsageError(str(exc)) from exc
    keys = [k.file.current() for k in out]
    if free_key is not None:
        keys.append(free_key if isinstance(free_key, str) else free_key.current())
    if len(set(keys)) < len(keys):
        raise UsageError("--api-key-class: two keys are the same; each tenant needs its own")
    return out


@dataclass(frozen=True)
class ClassKeyFile:
    slo_class: str
    file: TokenFile


def chat_template(path: Path | None) -> str | None:
    """--chat-template's text, compiled once now so that a broken file fails at start."""
    if path is None:
        return None
    try:
        return ChatTemplate.from_file(path, {}).source
    except OSError as exc:
        raise UsageError(f"--chat-template {path}: {exc.strerror}") from exc
    except (ChatTemplateError, UnicodeDecodeError) as exc:
        raise UsageError(f"--chat-template {path}: {exc}") from exc


def engine_options(args: argparse.Namespace, config: BatchingConfig) -> EngineOptions:
    if args.kv_cache_mb is not None and args.kv_cache_mb <= 0:
        raise UsageError(f"--kv-cache-mb must be positive, got {args.kv_cache_mb:g}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be at least 1, got {args.threads}")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise UsageError(f"--max-model-len must be at least 1, got {args.max_model_len}")
    if args.max_wait_ms is not None and args.mode != "static":
        raise UsageError("--max-wait-ms applies to --mode static only")
    if args.max_wait_ms is not None and args.max_wait_ms < 0:
        raise UsageError(f"--max-wait-ms must be >= 0, got {args.max_wait_ms:g}")
    if not args.class_max_wait_s >= 0:
        raise UsageError(f"--class-max-wait-s must be >= 0, got {args.class_max_wait_s:g}")
    if (tokens := args.lower_class_prefill_tokens) < 1:
        # none would stop a lower class's prompt while a higher class decodes
        raise UsageError(f"--lower-class-prefill-tokens must be at least 1, got {tokens}")
    check_model_reference(args.model)
    return EngineOptions(
        mode=args.mode,
        config=config,
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        served_model_name=args.served_model_name,
        device=args.device,
        kv_cache_mb=args.kv_cache_mb or EngineOptions.kv_cache_mb,
        # Only a GPU uses it, and only when no explicit size was given.
        gpu_memory_fraction=None if args.kv_cache_mb else GPU_MEMORY_FRACTION,
        threads=default_threads() if args.threads is None else args.threads,
        seed=args.seed,
        attention=args.attention,
        dynamic_execution=args.dynamic_execution,
        max_wait_ms=args.max_wait_ms,
        prefix_caching=args.prefix_caching,
        class_max_wait_s=args.class_max_wait_s,
        lower_class_prefill_tokens=args.lower_class_prefill_tokens,
    )


def check_model_reference(model: str) -> None:
    """A preset name or an existing path; what the files hold is checked at load."""
    path = Path(model)
    if model in PRESET_NAMES or path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return
    what = "no such file or directory" if not path.exists() else "not a directory or a .gguf file"
    raise UsageError(
        f"--model {model!r}: {what}; give a preset ({', '.join(PRESET_NAMES)}), a Hugging "
        "Face model directory or a .gguf file"
    )
