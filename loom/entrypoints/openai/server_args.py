"""`ServerArgs`: what `loom serve` needs beyond the engine (the HTTP side). Each field is also a
`loom serve` flag, generated from its `flag(...)` declaration (loom.engine.arg_utils): adding a
server option is adding a field here."""

from __future__ import annotations

from dataclasses import dataclass

from loom.engine.arg_utils import (
    LOG_LEVELS, SERVER, flag, non_negative_float, non_negative_int, positive_int,
)
from loom.tools.parsers import PARSERS
from loom.tools.reasoning import MODES as REASONING_MODES

DEFAULT_GRACE_SECONDS = 10.0
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20
API_KEY_ENV = "LOOM_API_KEY"


@dataclass(frozen=True)
class ServerArgs:
    host: str = flag("127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)", SERVER)
    port: int = flag(8000, "TCP port to listen on", SERVER)
    api_key: str | None = flag(
        None, "require `Authorization: Bearer KEY` on every route except /health, /version and "
              f"/metrics (default: ${API_KEY_ENV} if set, else no key)", SERVER)
    tool_call_parser: str = flag(
        "auto", "how tool calls appear in the model's output; auto: from the chat template "
                "(hermes when the template knows no tools)", SERVER, choices=("auto", *PARSERS))
    reasoning_parser: str = flag(
        "auto", "a thinking model's `<think> ... </think>` block goes to the message's "
                "`reasoning_content` (streamed as delta.reasoning_content), the rest to "
                "`content`; auto: where the chat template knows such blocks; deepseek_r1 / "
                "qwen3 (vLLM's names): always; none: left in content", SERVER,
        choices=REASONING_MODES)
    max_waiting_requests: int | None = flag(
        None, "answer 429 (with Retry-After) when this many requests already wait to be "
              "scheduled (default: two full batches: --max-num-seqs, or as many 256-token "
              "requests as the KV cache holds if more; shown in /metrics)", SERVER,
        type=non_negative_int)
    max_request_body_bytes: int = flag(
        DEFAULT_MAX_REQUEST_BODY_BYTES, "answer 413 to a request body larger than this",
        SERVER, type=positive_int)
    disable_log_requests: bool = flag(
        False, "do not log each request and its sampling parameters (nor the access log)", SERVER)
    timeout_graceful_shutdown: float = flag(
        DEFAULT_GRACE_SECONDS, "seconds running requests get to finish after SIGTERM/SIGINT "
                               "before they are aborted with an error", SERVER,
        type=non_negative_float)
    log_level: str = flag("info", "server log level", SERVER, choices=LOG_LEVELS)
    data_parallel_size: int = flag(
        1, "engine replicas: N > 1 starts N `loom serve` processes on internal loopback ports "
           "and the cache-aware router (`loom router`) on --host/--port in front of them; "
           "each gets cores/N threads unless --num-threads is set", SERVER, type=positive_int)
