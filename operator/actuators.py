"""Actuators: the tuning loop's plug point that keeps the config in force.

Each actuator holds the config of record, the one every target must run
(`in_force`); `apply` records a new one first and then pushes it to every
target; `resync` pushes the one in force again to the targets that hold
other values (one refused a push, restarted, or started from an older
record). A decision is in force once it is recorded, whether or not every
target took it: the targets that did not are brought in line by `resync`.

- `LocalActuator`: plain server URLs (`batchpilot tune`, the demo); the
  record is kept in memory, starting from what the first server held, and
  optionally in a JSON file that servers started later read with
  `--config-file`, as pods read the ConfigMap. The URLs may change between
  rounds (`follow`: a local fleet scaling).
- `KubernetesActuator`: the record is the policy's ConfigMap (pods that start
  later read it, and a restarted operator resumes from it); the targets are
  the round's ready pods, with the token from the policy's Secret.

Only the tuned knobs (`max_batch_size`, `batch_timeout_ms`,
`prefill_token_budget`, `num_speculative_tokens`) and the SLO's targets
(`slo`, which the pods judge each request against) are sent; the queue size
stays whatever the server was started with. A server older than some of
these fields is sent the ones it knows. A refusal never raises: it is
reported per target so the caller can record it.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from batchpilot_operator import builders
from batchpilot_operator.kube import Client
from batchpilot_operator.pods import ReadyPod
from batchpilot_operator.reconcile import read_admin_token, read_config, write_config
from batchpilot_operator.tuning_loop import ActuationReport, Applied, Refused
from batchpilot_server.batching_config import FIELDS, BatchingConfig

PUT_TIMEOUT_S = 5.0
TUNED_FIELDS = (
    "max_batch_size", "batch_timeout_ms", "prefill_token_budget", "num_speculative_tokens", "slo",
)  # fmt: skip
# The fields older servers do not take (nor report in GET /admin/batching), newest
# first: a server that refuses one as unknown is older than it and everything after it
# in this list, and takes none of those.
NEWER_FIELDS = (("num_speculative_tokens",), ("prefill_token_budget", "slo"))


def tuned_body(config: BatchingConfig) -> dict[str, Any]:
    # k always, 0 included (to_dict leaves 0 out for older servers' ConfigMaps): a PUT
    # without it would leave a server that speculates at the k it had
    data = {**config.to_dict(), "num_speculative_tokens": config.num_speculative_tokens}
    return {key: data[key] for key in TUNED_FIELDS}


def same_tuned(a: BatchingConfig, b: BatchingConfig) -> bool:
    return tuned_body(a) == tuned_body(b)


async def put_batching(
    session: aiohttp.ClientSession, url: str, token: str | None, config: BatchingConfig, name: str
) -> Applied | Refused:
    """PUT the tuned knobs and the SLO's targets to one server; a refusal comes back with
    the server's words. A server older than some fields (it refuses one as unknown) gets
    the knobs it knows: it is still tuned, but without what it lacks (speculation, or
    the SLO's attainment)."""
    body = tuned_body(config)
    result, unknown = await _put(session, url, token, body, name)
    while unknown is not None and (older := _older_body(body, unknown)) != body:
        body = older
        result, unknown = await _put(session, url, token, body, name)
    return result


def _older_body(body: dict[str, Any], unknown: str) -> dict[str, Any]:
    """`body` as a server that refused `unknown` takes it: without that field's
    generation and the newer ones (unchanged when `unknown` is none of NEWER_FIELDS)."""
    for index, fields in enumerate(NEWER_FIELDS):
        if unknown in fields:
            dropped = {key for newer in NEWER_FIELDS[: index + 1] for key in newer}
            return {key: value for key, value in body.items() if key not in dropped}
    return body


async def _put(
    session: aiohttp.ClientSession, url: str, token: str | None, body: dict[str, Any], name: str
) -> tuple[Applied | Refused, str | None]:
    """The server's answer, and the field it refused as unknown (if that was why)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with session.put(
            f"{url.rstrip('/')}/admin/batching",
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=PUT_TIMEOUT_S),
        ) as response:
            status, text = response.status, await response.text()
    except TimeoutError:
        return Refused(name, f"timed out: no answer within {PUT_TIMEOUT_S:g} s"), None
    except aiohttp.ClientError as exc:
        return Refused(name, f"unreachable: {exc or type(exc).__name__}"), None
    answer = _json_or_none(text)
    if status != 200:
        words = _error_message(answer) if answer else text[:120]
        return Refused(name, f"HTTP {status}: {words}"), _unknown_field(answer)
    return Applied(name, answer.get("version") if isinstance(answer, dict) else None), None


def _unknown_field(answer: Any) -> str | None:
    """The field an HTTP 400 named as unknown (OpenAI's error shape), if that was the cause."""
    error = answer.get("error") if isinstance(answer, Mapping) else None
    if isinstance(error, Mapping) and error.get("code") == "unknown_field":
        return str(error.get("param"))
    return None


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


async def get_batching(
    session: aiohttp.ClientSession, url: str, base: BatchingConfig | None = None
) -> BatchingConfig:
    """The config a server has in force (GET /admin/batching needs no token); a field an
    older server does not report is `base`'s (the defaults without one)."""
    async with session.get(
        f"{url.rstrip('/')}/admin/batching", timeout=aiohttp.ClientTimeout(total=PUT_TIMEOUT_S)
    ) as response:
        response.raise_for_status()
        body = await response.json()
    reported = {k: body[k] for k in FIELDS if k in body}
    return BatchingConfig.from_dict(reported, base)


async def held_config(
    session: aiohttp.ClientSession, url: str, in_force: BatchingConfig
) -> BatchingConfig | None:
    """What a server holds, as far as it says (an older server is not pushed again for
    fields it cannot take); None when it cannot tell (down, or not answering yet)."""
    try:
        return await get_batching(session, url, in_force)
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
        return None


def _error_message(body: Any) -> str:
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        return str(body["error"].get("message"))
    return str(body)


class LocalActuator:
    """Plain server URLs; the config of record lives in memory (and in `config_file`)."""

    def __init__(
        self,
        urls: Sequence[str],
        token: str | None,
        session: aiohttp.ClientSession,
        in_force: BatchingConfig,
        config_file: Path | None = None,
    ) -> None:
        self.token = token
        self.session = session
        self.config_file = config_file
        self.follow(urls)
        self._record(in_force)

    def follow(self, urls: Sequence[str]) -> None:
        """Push to these servers from now on (the fleet changed)."""
        if not urls:
            raise ValueError("the local actuator needs at least one server URL")
        self.targets = [ReadyPod(url, url) for url in urls]

    async def in_force(self) -> BatchingConfig:
        return self._in_force

    async def apply(self, config: BatchingConfig) -> ActuationReport:
        self._record(config)
        return await push(self.session, self.targets, self.token, config)

    def _record(self, config: BatchingConfig) -> None:
        self._in_force = config
        if self.config_file is not None:
            write_config_file(self.config_file, config)

    async def resync(self, config: BatchingConfig) -> ActuationReport:
        return await resync(self.session, self.targets, lambda: _given(self.token), config)


class KubernetesActuator:
    """A policy's ConfigMap, then the round's ready pods of the policy."""

    def __init__(
        self,
        client: Client,
        session: aiohttp.ClientSession,
        namespace: str,
        policy_name: str,
        pods: Sequence[ReadyPod],
    ) -> None:
        self.client = client
        self.session = session
        self.namespace = namespace
        self.policy_name = policy_name
        self.pods = list(pods)

    async def in_force(self) -> BatchingConfig | None:
        """The ConfigMap's config; None before reconcile wrote it."""
        return await read_config(self.client, self.namespace, self.policy_name)

    async def apply(self, config: BatchingConfig) -> ActuationReport:
        await write_config(self.client, self.namespace, self.policy_name, config)
        token = await self._token()
        report = await push(self.session, self.pods, token, config)
        report.config_map_written = True
        if token is None:
            report.refused.insert(
                0, Refused(builders.secret_name(self.policy_name), "admin token Secret missing")
            )
        return report

    async def resync(self, config: BatchingConfig) -> ActuationReport:
        return await resync(self.session, self.pods, self._token, config)

    async def _token(self) -> str | None:
        return await read_admin_token(self.client, self.namespace, self.policy_name)


def write_config_file(path: Path, config: BatchingConfig) -> None:
    """`config` as `batchpilot serve --config-file` reads it; replaced whole, so a server
    starting meanwhile reads the old record or the new one, never half of one."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(config.to_dict(), sort_keys=True))
    os.replace(partial, path)


async def push(
    session: aiohttp.ClientSession,
    targets: Sequence[ReadyPod],
    token: str | None,
    config: BatchingConfig,
) -> ActuationReport:
    """PUT `config` to every target."""
    results = await asyncio.gather(
        *(put_batching(session, t.url, token, config, t.name) for t in targets)
    )
    return _report(results)


async def resync(
    session: aiohttp.ClientSession,
    targets: Sequence[ReadyPod],
    token: Callable[[], Awaitable[str | None]],
    config: BatchingConfig,
) -> ActuationReport:
    """PUT `config` to the targets whose tuned knobs differ from it; a target that
    cannot say what it holds is left for the next round. The token is fetched only
    when some target needs the push."""
    held = await asyncio.gather(*(held_config(session, t.url, config) for t in targets))
    drifted = [
        target
        for target, config_held in zip(targets, held, strict=True)
        if config_held is not None and not same_tuned(config_held, config)
    ]
    if not drifted:
        return ActuationReport()
    return await push(session, drifted, await token(), config)


async def _given(token: str | None) -> str | None:
    return token


def _report(results: Sequence[Applied | Refused]) -> ActuationReport:
    report = ActuationReport()
    for result in results:
        if isinstance(result, Applied):
            report.applied.append(result)
        else:
            report.refused.append(result)
    return report
