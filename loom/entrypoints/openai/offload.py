"""Work a handler would rather keep off the event loop (parsing a body, tokenizing, templating),
run on a worker thread unless it is small.

A worker thread costs two thread switches on the request's path (to the thread and back to the
loop): ~0.1 ms on an idle machine, milliseconds on a loaded one, where each switch waits for a
core. A short request's work costs less than that (a 1 KB body parses in ~0.1 ms, an 850-character
prompt tokenizes in ~0.5 ms), so it runs on the loop; a large one still goes to a thread, so a
large body never stalls the loop (and with it /health and every running stream) for long.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from loom.tokenizer.tokenizer import ENCODE_IN_PLACE_CHARS

P = ParamSpec("P")
T = TypeVar("T")

# Up to these sizes the work runs on the event loop (each well under a millisecond of CPU).
INLINE_BODY_BYTES = 16 * 1024  # a request body, parsed and validated
# Text to tokenize or render in the chat template: the same bound as the text Tokenizer.encode
# encodes holding the GIL (past it, encoding releases the GIL, worth a thread's switches).
INLINE_TEXT_CHARS = ENCODE_IN_PLACE_CHARS


async def run_sized(
    size: int, limit: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs
) -> T:
    """`fn(*args, **kwargs)` on the loop when `size <= limit`, else on a worker thread.

    Exceptions propagate either way."""
    if size <= limit:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)
