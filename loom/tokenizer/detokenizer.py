"""Incremental detokenization with stop-string detection, one instance per request.

Decoding uses `tokenizers.decoders.DecodeStream`, which re-decodes only a small window of recent
ids per token and returns None while the text would end in a partial UTF-8 character (byte-level
BPE pieces, SentencePiece byte-fallback tokens), so no delta ever carries a broken character.
The stream is primed with the end of the prompt so the first output token keeps its leading space
(SentencePiece decoders strip one at the start of a sequence).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from loom.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"
# Bounds on the prompt tokens used as decoding context for the first output token.
_MIN_PRIME = 4
_MAX_PRIME = 24


class IncrementalDetokenizer:
    """Turns a request's output token ids into text, one step at a time.

    Invariants:
    - `output_text` is the decoded text of every complete character so far; after a stop string
      matched it ends at the stop string (or just before it, unless include_stop_str_in_output).
    - Text handed out by `get_next_output_text` is a prefix of `output_text`. While unfinished it
      holds back the last len(longest stop)-1 characters when stop strings are removed from the
      output, so a partial stop string is never streamed.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.stop: list[str] = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1
            if self.stop and not self.include_stop_str_in_output
            else 0
        )
        self.output_token_ids: list[int] = []
        self.stop_str: str | None = None  # the stop string that ended the request, if any
        self._text = ""
        self._sent_offset = 0  # characters of _text already returned as deltas
        self._prime = self._choose_prime(prompt_token_ids)
        self._pending_start = 0  # index of the first output token not yet turned into text
        self._flushed = False
        self._stream = DecodeStream(ids=self._prime, skip_special_tokens=self.skip_special_tokens)

    def _choose_prime(self, prompt_token_ids: list[int]) -> list[int]:
        """The shortest prompt suffix of 4..24 tokens that decodes without U+FFFD.

        DecodeStream diffs against the decoded prime; a prime with a broken character may stop
        being a prefix once more tokens are decoded after it (vLLM picks its prefix this way).
        Failing that, the last 4 tokens minus any that end in an incomplete character.
        """
        n = len(prompt_token_ids)
        for size in range(min(n, _MIN_PRIME), min(n, _MAX_PRIME) + 1):
            prime = prompt_token_ids[n - size:]
            if _REPLACEMENT_CHAR not in self._decode(prime):
                return prime
        prime = prompt_token_ids[-_MIN_PRIME:]
        while prime and self._decode(prime).endswith(_REPLACEMENT_CHAR):
            prime = prime[:-1]
        return prime

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    @property
    def output_text(self) -> str:
        """All text so far; ends at (or before) the matched stop string, if any."""
        return self._text

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append newly generated tokens; return the stop string they complete, else None.

        Tokens are decoded one at a time and checking stops at the first token that completes
        a stop string: later tokens in `new_token_ids` add no text. Stop strings are not looked
        for in the text of the first `min_tokens` tokens (vLLM's rule). Once stopped, further
        calls change nothing and return the same stop string.
        """
        if self.stop_str is not None:
            return self.stop_str
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            chunk = self._stream.step(self.tokenizer, token_id)
            if chunk is None:
                continue
            self._pending_start = len(self.output_token_ids)
            start = len(self._text)
            self._text += chunk
            if self.stop and len(self.output_token_ids) > self.min_tokens:
                stop_str = self._find_stop(start)
                if stop_str is not None:
                    self.stop_str = stop_str
                    return stop_str
        return None

    def _find_stop(self, new_text_start: int) -> str | None:
        """Search text from new_text_start (minus len(stop)-1) for the earliest stop string.

        On a match, truncate `_text` before the stop string, or after it when it is kept.
        """
        best_index, best_stop = -1, None
        for stop in self.stop:
            index = self._text.find(stop, max(0, new_text_start - len(stop) + 1))
            if index != -1 and (best_stop is None or index < best_index):
                best_index, best_stop = index, stop
        if best_stop is None:
            return None
        end = best_index + len(best_stop) if self.include_stop_str_in_output else best_index
        self._text = self._text[:end]
        return best_stop

    def _flush(self) -> None:
        """At finish, add text of trailing tokens that never completed a character.

        The stream holds those back hoping for the rest of the character; at the end they are
        decoded as they are (with U+FFFD), matching `tokenizer.decode` of all output ids.
        """
        self._flushed = True
        pending = self.output_token_ids[self._pending_start:]
        if self.stop_str is not None or not pending:
            return
        before = self.output_token_ids[: self._pending_start]
        context = before[-1:] if before else self._prime[-1:]
        head = self._decode(context)
        text = self._decode(context + pending)
        if text.startswith(head):
            self._text += text[len(head):]

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to send now: new text since the last delta call (delta) or all text so far.

        While not finished, the last `stop_buffer_length` characters are withheld, so a stop
        string that is only partly generated is never streamed; `finished` releases them.
        """
        if finished and not self._flushed:
            self._flush()
        buffer = 0 if finished else self.stop_buffer_length
        length = max(0, len(self._text) - buffer)
        if not delta:
            return self._text[:length]
        if length <= self._sent_offset:
            return ""
        text = self._text[self._sent_offset:length]
        self._sent_offset = length
        return text
