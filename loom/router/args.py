"""`RouterArgs`: the router's settings; each flag field is also a `loom router` flag."""

from __future__ import annotations

from dataclasses import dataclass

from loom.engine.arg_utils import (
    LOG_LEVELS, SERVER, flag, non_negative_int, positive_float, positive_int,
)

ROUTER = "router"
POLICIES = ("cache_aware", "round_robin", "least_load")


@dataclass(frozen=True)
class RouterArgs:
    backends: tuple[str, ...] = ()  # base URLs of the replicas (`--backend`, given apart)
    host: str = flag("127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)", SERVER)
    port: int = flag(8000, "TCP port to listen on", SERVER)
    policy: str = flag(
        "cache_aware", "cache_aware: the replica that served the longest leading part of the "
                       "prompt, unless much busier than the least busy one; round_robin; "
                       "least_load (fewest running + waiting requests)", ROUTER,
        choices=POLICIES)
    block_chars: int = flag(
        64, "characters of prompt text per affinity block (~16 tokens of English)", ROUTER,
        type=positive_int)
    balance_abs_threshold: int = flag(
        4, "cache_aware leaves the prefix's replica for the least busy one when its load "
           "(running + waiting) exceeds the least one's by more than this ...", ROUTER,
        type=non_negative_int)
    balance_rel_threshold: float = flag(
        1.5, "... and is more than this many times the least one's", ROUTER,
        type=positive_float)
    health_check_interval: float = flag(
        1.0, "seconds between health and load checks of each replica", ROUTER,
        type=positive_float)
    max_attempts: int = flag(
        3, "replicas a request is tried on before it fails (only while nothing was streamed)",
        ROUTER, type=positive_int)
    log_level: str = flag("info", "log level", SERVER, choices=LOG_LEVELS)
