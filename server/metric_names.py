"""Prometheus metric names (the README's Metrics table). Torch-free: the tuner imports it."""

REQUEST_DURATION = "batchpilot_request_duration_seconds"
TIME_TO_FIRST_TOKEN = "batchpilot_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "batchpilot_inter_token_latency_seconds"
QUEUE_WAIT = "batchpilot_queue_wait_seconds"
BATCH_SIZE = "batchpilot_batch_size"
# One engine step (its one forward over prefill and decode rows, and sampling): _count is the steps,
# _sum their seconds, which pair with the step counters below in a step-time model.
STEP_DURATION = "batchpilot_step_duration_seconds"
# What the steps computed: decode rows, prompt tokens of prefill rows
# (prefix-cache hits are not computed), and KV tokens attended (each row's context length
# at its step, summed)
STEP_DECODE_ROWS_TOTAL = "batchpilot_step_decode_rows_total"
STEP_PREFILL_TOKENS_TOTAL = "batchpilot_step_prefill_tokens_total"
STEP_KV_TOKENS_TOTAL = "batchpilot_step_kv_tokens_total"
# The engine thread's time on steps, forwards and all around them: what the pod is busy.
ENGINE_BUSY_SECONDS_TOTAL = "batchpilot_engine_busy_seconds_total"
HOSTAGE = "batchpilot_hostage_seconds"
KV_CACHE_USAGE = "batchpilot_kv_cache_usage_ratio"
# The KV pool in tokens (its blocks x a block's tokens): the batch a pod's KV can hold.
KV_CACHE_CAPACITY_TOKENS = "batchpilot_kv_cache_capacity_tokens"
REQUESTS_RUNNING = "batchpilot_requests_running"
REQUESTS_WAITING = "batchpilot_requests_waiting"
# The waiting requests by SLO class (label class): the queue a class waits behind is
# its own and the higher classes', which are served first.
REQUESTS_WAITING_BY_CLASS = "batchpilot_requests_waiting_by_class"
REQUESTS_TOTAL = "batchpilot_requests_total"  # label outcome: ok|rejected|timeout|error
# Every generation request as it arrives, before admission: the load the fleet is offered.
REQUESTS_ARRIVED_TOTAL = "batchpilot_requests_arrived_total"
PROMPT_TOKENS_TOTAL = "batchpilot_prompt_tokens_total"
GENERATION_TOKENS_TOTAL = "batchpilot_generation_tokens_total"
# Output tokens per finished request: the length spread `batching.mode: auto` reads.
REQUEST_GENERATION_TOKENS = "batchpilot_request_generation_tokens"
# Prompt tokens per finished request (each choice, as the output lengths).
REQUEST_PROMPT_TOKENS = "batchpilot_request_prompt_tokens"
# Each completed request's mean time per output token after its first (the tpot target's
# quantity; a one-token answer has none).
REQUEST_TIME_PER_OUTPUT_TOKEN = "batchpilot_request_time_per_output_token_seconds"
# Requests judged against their SLO class's targets as they end, labels class, result
# (met|missed) and target (ttft|tpot|e2e, and all: every stated target held); nothing
# grows in a class that states no target.
REQUESTS_SLO_TOTAL = "batchpilot_requests_slo_total"
SLO_RESULTS = ("met", "missed")
SLO_STATED = ("ttft", "tpot", "e2e")  # the targets a policy may state
SLO_ALL = "all"  # every stated target held
SLO_TARGETS = (*SLO_STATED, SLO_ALL)
# The request's SLO class (docs/server.md), on the SLO counter and the request latency
# histograms; vLLM's names keep their labels, which gateways read.
CLASS_LABEL = "class"
PREEMPTIONS_TOTAL = "batchpilot_preemptions_total"
# Tokens of admitted sequences looked up in the prefix cache, and those found there (not
# computed again); hits / queries is the cache's hit rate.
PREFIX_CACHE_QUERIES_TOTAL = "batchpilot_prefix_cache_queries_total"
PREFIX_CACHE_HITS_TOTAL = "batchpilot_prefix_cache_hits_total"
# Speculative decoding (n-gram prompt lookup): draft tokens verified, and of them the
# ones accepted; accepted / drafted is the acceptance rate
SPEC_DRAFT_TOKENS_TOTAL = "batchpilot_spec_decode_draft_tokens_total"
SPEC_ACCEPTED_TOKENS_TOTAL = "batchpilot_spec_decode_accepted_tokens_total"
# label state: token positions of executed batches by what they were for (scheduler.SlotSteps)
BATCH_SLOT_STEPS_TOTAL = "batchpilot_batch_slot_steps_total"
# label phase: compile (a schema, in the request handler) | mask (one step's grammar rows)
STRUCTURED_OUTPUT = "batchpilot_structured_output_seconds"
STRUCTURED_OUTPUT_PHASES = ("compile", "mask")
CONFIG_MAX_BATCH_SIZE = "batchpilot_config_max_batch_size"
CONFIG_BATCH_TIMEOUT = "batchpilot_config_batch_timeout_seconds"
CONFIG_PREFILL_TOKEN_BUDGET = "batchpilot_config_prefill_token_budget"
# label target: ttft|tpot|e2e, the stated ones only
SLO_TARGET = "batchpilot_slo_target_seconds"

# vLLM's names for the same quantities (--metrics-compat vllm), label model_name
VLLM_REQUESTS_RUNNING = "vllm:num_requests_running"
VLLM_REQUESTS_WAITING = "vllm:num_requests_waiting"
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # 0..1 despite the name, as vLLM's
VLLM_TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
VLLM_INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
VLLM_E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
VLLM_REQUEST_QUEUE_TIME = "vllm:request_queue_time_seconds"
VLLM_REQUEST_TIME_PER_OUTPUT_TOKEN = "vllm:request_time_per_output_token_seconds"
VLLM_PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"
VLLM_GENERATION_TOKENS_TOTAL = "vllm:generation_tokens_total"
VLLM_CACHE_CONFIG_INFO = "vllm:cache_config_info"
VLLM_SPEC_DECODE_NUM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_SPEC_DECODE_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_SPEC_DECODE_NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
# label position: the draft position (0 first) of each accepted token
VLLM_SPEC_DECODE_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"

OUTCOMES = ("ok", "rejected", "timeout", "error")
SLOT_STATES = ("active", "finished", "padding")
# Every series carries these labels; Prometheus adds `policy`, `namespace`, `pod`.
COMMON_LABELS = ("model", "mode")

# Shared histogram buckets for the latency histograms, in seconds: fine enough
# around typical SLOs (50 ms .. 2 s) that a p99 read from them is within ~10%.
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.25,
    0.3,
    0.4,
    0.5,
    0.6,
    0.75,
    1.0,
    1.25,
    1.5,
    2.0,
    2.5,
    3.0,
    4.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
)

# Output lengths of 1..8192 tokens, each bucket at most 1.5x the one below: equal
# lengths above one token then read a p90/p50 of at most 1.27 (one bucket, interpolated), while the
# narrowest spread of docs/batching.md's map (uniform 16..112) reads about 1.6.
GENERATION_TOKEN_BUCKETS = (
    1,
    2,
    3,
    4,
    6,
    8,
    12,
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    192,
    256,
    384,
    512,
    768,
    1024,
    1536,
    2048,
    3072,
    4096,
    6144,
    8192,
)

# Prompt lengths: the output lengths' buckets, then on to long-context prompts (128k).
PROMPT_TOKEN_BUCKETS = (
    *GENERATION_TOKEN_BUCKETS,
    12288,
    16384,
    24576,
    32768,
    49152,
    65536,
    98304,
    131072,
)
