"""The pods' series for the LLM SLO and the step-time model, as the operator reads them.

The server exports them (see the metrics reference); older servers export none, and
every signal built from them is then None. `SLO_TOTAL` counts each judged request
once with target="all" (result met or missed) and once per stated target it missed.
"""

from __future__ import annotations

SLO_TOTAL = "batchpilot_requests_slo_total"  # labels result: met|missed, target
SLO_ALL = "all"
SLO_TARGETS = ("ttft", "tpot", "e2e")
TIME_PER_OUTPUT_TOKEN = "batchpilot_request_time_per_output_token_seconds"
REQUEST_PROMPT_TOKENS = "batchpilot_request_prompt_tokens"
STEP_DECODE_ROWS_TOTAL = "batchpilot_step_decode_rows_total"
STEP_PREFILL_TOKENS_TOTAL = "batchpilot_step_prefill_tokens_total"
STEP_KV_TOKENS_TOTAL = "batchpilot_step_kv_tokens_total"
