"""Incremental detokenization with stop-string matching, for streaming text deltas.

Two things make streaming text harder than ``tokenizer.decode(output_ids)`` at the end:

1. **Split characters.** A byte-level BPE token can end in the middle of a UTF-8 character (an
   emoji is 4 bytes, often 2-3 tokens). Decoding such a prefix gives U+FFFD. We use the
   prefix/read-offset scheme of Hugging Face TGI and vLLM's slow incremental detokenizer: keep a
   window ``token_ids[prefix_offset:]``, decode it, and emit the part beyond the decode of
   ``token_ids[prefix_offset:read_offset]`` only when the new decode does not end in U+FFFD;
   otherwise hold and retry with the next token. One refinement over vLLM: text before the
   split character is emitted at once (later bytes cannot change it), so a token that carries
   "abc" plus the first byte of a character does not delay "abc". Decoding a few tokens of
   context (the tail of the prompt, then the previous emission) keeps tokenizers whose decoders
   depend on neighbours (SentencePiece's leading-space rule) right::

       token_ids:  ... prompt tail | out0 out1 out2 out3
                       ^prefix_offset    ^read_offset      ^len
       prefix_text = decode(ids[prefix_offset:read_offset])
       new_text    = decode(ids[prefix_offset:])  -> emit new_text[len(prefix_text):];
                                                     if it ends in U+FFFD, emit only up to the
                                                     trailing U+FFFD run and keep the offsets

2. **Stop strings.** They are matched on the stable output text (never on held bytes). Text
   that could still be the beginning of a stop string is held back until it either completes
   the match (then the output is truncated before the stop string, vLLM's default
   ``include_stop_str_in_output=False``) or can no longer match (then it is emitted). We hold only
   the longest suffix that is a prefix of some stop string, not vLLM's fixed
   ``max(len(stop)) - 1`` characters, so unrelated text is never delayed.

Guarantee (tested): with a byte-level tokenizer and a prompt that ends on a character boundary
(a character split between prompt and output is attributed to the prompt), the deltas of ``update``
followed by ``finish()`` concatenate to ``tokenizer.decode(output_ids)`` (with the stop string
and what follows it removed, and without the text of a terminating stop token, see below), and
no delta contains a U+FFFD that the full decode does not have.

vLLM rules kept: the text of the token that finishes the request as EOS or as one of
``stop_token_ids`` is not part of the output; stop strings only match when they end in text
produced after the first ``min_tokens`` tokens; when several stop strings complete with the same
token, the one that starts first wins (vLLM takes the first in list order; we prefer the
earliest in the text, which is what a client reading the text expects).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from replica.engine.params import EosTokenIds, SamplingParams, eos_token_set

# Prompt tokens decoded as context before the first output token (vLLM uses a similar few).
_PROMPT_CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Per-request text state: output token ids -> stable text deltas, with stop strings.

    Args:
        tokenizer: the model's ``tokenizers.Tokenizer``.
        prompt_token_ids: the prompt; its last few tokens are decoded as context only (never
            emitted).
        params: the request's sampling params (``stop``, ``stop_token_ids``, ``min_tokens``,
            ``ignore_eos`` are used).
        skip_special_tokens: drop special tokens from the text (vLLM's default).
        eos_token_id: the model's EOS id (or ids), so that a terminating EOS contributes no text
            even when the tokenizer does not mark it special; ``None`` when unknown.
        single_token_text: a memo of one-token decodes (token id -> text) to share between the
            requests of one tokenizer and ``skip_special_tokens`` setting (the engine passes one);
            ``None`` keeps a private one. After each clean character boundary the new prefix
            window is usually the one newest token, so this halves the decode calls per token.

    Attributes:
        matched_stop: the stop string that finished the request, else ``None``.
        output_text: the stable output text so far (truncated before a matched stop string);
            held-back text is included, bytes of an incomplete character are not.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        skip_special_tokens: bool = True,
        *,
        eos_token_id: EosTokenIds = None,
        single_token_text: dict[int, str] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._single_token_text = {} if single_token_text is None else single_token_text
        self._stop = params.stop
        self._min_tokens = params.min_tokens
        self._stop_token_ids = frozenset(params.stop_token_ids)
        self._eos_token_ids = frozenset() if params.ignore_eos else eos_token_set(eos_token_id)

        self._token_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids)
        self._window_taken = 0  # chars beyond prefix_text already taken from the current window

        self._num_output_tokens = 0
        self.output_text = ""
        self._emitted = 0  # chars of output_text already returned
        # Stop strings must end beyond this many chars of output_text (the text of the first
        # min_tokens tokens), vLLM's min_tokens rule for stop strings.
        self._stop_boundary = 0
        self.matched_stop: str | None = None
        self._finished = False

    @property
    def num_output_tokens(self) -> int:
        """Output tokens seen by ``update`` so far."""
        return self._num_output_tokens

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Append newly generated tokens; return the text that became safe to emit.

        Args:
            new_token_ids: the tokens generated since the last call (usually one).

        Returns:
            The new text delta (possibly empty). Held text (an incomplete character, a possible
            stop-string prefix) comes out in a later call or in ``finish()``. Once a stop string
            has matched, every later call returns ``""``.
        """
        if self._finished:
            return ""
        for token_id in new_token_ids:
            self._num_output_tokens += 1
            if self._is_terminating_stop_token(token_id):
                # vLLM leaves the text of the EOS / stop token out of the output.
                continue
            self._token_ids.append(token_id)
            old_len = len(self.output_text)
            self.output_text += self._decode_next()
            if self._num_output_tokens <= self._min_tokens:
                self._stop_boundary = len(self.output_text)
            elif self._stop and len(self.output_text) > old_len and self._match_stop(old_len):
                break
        return self._take(final=self._finished)

    def finish(self) -> str:
        """Flush at the end of the request: return everything still held.

        Held stop-string prefixes are emitted (they did not match), and bytes of a character that
        never completed are decoded as U+FFFD, as ``tokenizer.decode`` would (that flushed tail is
        not matched against stop strings: it is only replacement characters). Returns ``""`` when
        a stop string matched (the text after it is discarded). Idempotent; ``update`` returns
        ``""`` afterwards.
        """
        if not self._finished:
            self._finished = True
            new_text = self._decode(self._token_ids[self._prefix_offset :])
            start = len(self._prefix_text) + self._window_taken
            if len(new_text) > start:
                self.output_text += new_text[start:]
            self._prefix_offset = self._read_offset = len(self._token_ids)
            self._prefix_text = ""
            self._window_taken = 0
        return self._take(final=True)

    def _is_terminating_stop_token(self, token_id: int) -> bool:
        if self._num_output_tokens < self._min_tokens:
            return False
        return token_id in self._eos_token_ids or token_id in self._stop_token_ids

    def _decode(self, token_ids: Sequence[int]) -> str:
        if len(token_ids) == 1:
            token_id = token_ids[0]
            text = self._single_token_text.get(token_id)
            if text is None:
                text = self._single_token_text[token_id] = self._tokenizer.decode(
                    [token_id], skip_special_tokens=self._skip_special_tokens
                )
            return text
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=self._skip_special_tokens)

    def _decode_next(self) -> str:
        """The stable text added by the window's newest token ("" when there is none yet).

        While the window ends in a split character, the text before it is already stable (UTF-8
        is self-synchronising: later bytes cannot change earlier characters), so it is returned
        at once and counted in ``_window_taken``; the offsets only move on a clean boundary.
        Trailing U+FFFD are all held, not just the split character's: conservative, since a real
        U+FFFD comes out with the next clean boundary or ``finish()``.
        """
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        start = len(self._prefix_text) + self._window_taken
        if new_text.endswith(_REPLACEMENT_CHAR):
            stable_end = len(new_text.rstrip(_REPLACEMENT_CHAR))
            if stable_end <= start:
                return ""
            self._window_taken += stable_end - start
            return new_text[start:stable_end]
        if len(new_text) <= start:
            return ""  # nothing new, e.g. a skipped special token
        delta = new_text[start:]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        self._window_taken = 0
        return delta

    def _match_stop(self, old_len: int) -> bool:
        """Find a stop string ending in ``output_text[max(old_len, boundary):]``; on a match,
        truncate the output before it, set ``matched_stop`` and return True."""
        text = self.output_text
        search_from = max(old_len, self._stop_boundary)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            # The earliest start of a match that ends after search_from.
            pos = text.find(stop, max(0, search_from - len(stop) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False
        pos, self.matched_stop = best
        self.output_text = text[:pos]
        self._finished = True
        return True

    def _take(self, final: bool) -> str:
        """Return and mark emitted the text up to the held-back suffix (all of it when final)."""
        end = len(self.output_text)
        if not final and self._stop:
            end -= self._held_suffix_len()
        if end <= self._emitted:
            return ""
        delta = self.output_text[self._emitted : end]
        self._emitted = end
        return delta

    def _held_suffix_len(self) -> int:
        """Length of the longest suffix of ``output_text`` that is a prefix of a stop string.

        Full stop strings count too: one that ended inside the ``min_tokens`` text did not match,
        but may still be the start of a longer stop string.
        """
        text = self.output_text
        longest = min(len(text), max(len(s) for s in self._stop))
        for n in range(longest, 0, -1):
            suffix = text[-n:]
            if any(s.startswith(suffix) for s in self._stop):
                return n
        return 0
