"""IncrementalDetokenizer (split UTF-8 characters, stop strings) and check_stop, on real tokenizers.

The fixture trains a small byte-level BPE (GPT-2 style: ByteLevel pre-tokenizer + decoder, all 256
bytes in the alphabet) on English, Chinese, emoji and accented text, so that real tokens split
multi-byte characters the way production tokenizers do.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from replica.engine.detokenizer import IncrementalDetokenizer
from replica.engine.params import FinishReason, SamplingParams
from replica.engine.stop import StopCheck, check_stop

EOS_TEXT = "<|endoftext|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefix caching lets a replica reuse the KV blocks of a shared prompt.",
    "Routing requests to the replica that already holds the longest prefix saves compute.",
    "我们的路由器把请求发送到已经缓存了最长前缀的副本。",
    "大语言模型推理需要大量的显存来存储键值缓存。",
    "Emoji test: 🚀🔥✨ 😀😃😄 👍🏽 🇯🇵",
    "Café, naïve, résumé, Straße, Ελληνικά, русский текст.",
    "STOP signs and stop words: END, ###, </s>.",
] * 20
TEXT_ALPHABET = "abcdefgh STOPEND#\n.,é中文路由器缓存🚀😀👍🏽ß"
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        min_frequency=2,
        special_tokens=[EOS_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def byte_tokens(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte of ``text``: every multi-byte character is split."""
    table = _byte_to_char()
    return [tok.token_to_id(table[b]) for b in text.encode()]


def run(tok, token_ids, params=None, prompt=None, chunks=None, eos=None, skip_special_tokens=True):
    """Feed ``token_ids`` (in ``chunks`` sizes, default one by one); return (deltas, final, detok)."""
    params = params or SamplingParams()
    prompt = tok.encode("Hello there. ").ids if prompt is None else prompt
    detok = IncrementalDetokenizer(tok, prompt, params, skip_special_tokens, eos_token_id=eos)
    deltas, i = [], 0
    for size in chunks or [1] * len(token_ids):
        deltas.append(detok.update(token_ids[i : i + size]))
        i += size
    deltas.append(detok.update(token_ids[i:]))
    return deltas, detok.finish(), detok


def test_fixture_tokenizer_is_byte_level_and_splits_characters(tok):
    assert tok.token_to_id(EOS_TEXT) == 0
    pieces = [tok.decode([i]) for i in tok.encode("我们的路由器 🚀").ids]
    assert any("\ufffd" in p for p in pieces)  # real tokens end mid-character
    assert all(tok.token_to_id(c) is not None for c in _byte_to_char().values())


@SETTINGS
@given(text=st.text(alphabet=TEXT_ALPHABET, max_size=40), data=st.data())
def test_deltas_concatenate_to_decode_of_encoded_text(tok, text, data):
    ids = tok.encode(text).ids
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    deltas, final, detok = run(tok, ids, chunks=chunks)
    assert "".join(deltas) + final == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.num_output_tokens == len(ids)


@SETTINGS
@given(text=st.text(alphabet=TEXT_ALPHABET, max_size=30))
def test_byte_per_token_output_never_emits_a_split_character(tok, text):
    ids = byte_tokens(tok, text)
    deltas, final, _ = run(tok, ids)
    assert "".join(deltas) == text and final == ""
    assert not any("\ufffd" in d for d in deltas)


@SETTINGS
@given(data=st.data())
def test_random_token_ids_concatenate_to_decode(tok, data):
    ids = data.draw(st.lists(st.integers(1, tok.get_vocab_size() - 1), max_size=40))
    deltas, final, _ = run(tok, ids)
    full = tok.decode(ids)
    assert "".join(deltas) + final == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas + [final])


def test_split_character_is_held_until_complete(tok):
    deltas, final, _ = run(tok, byte_tokens(tok, "a🚀"))
    assert deltas[:5] == ["a", "", "", "", "🚀"] and final == ""


def test_text_before_a_split_character_is_not_delayed(tok):
    # One real token carries complete characters plus the first bytes of the next one.
    ids = tok.encode("我们的路由器").ids
    first = tok.decode(ids[:1])
    assert first.endswith("\ufffd") and len(first.rstrip("\ufffd")) > 0
    deltas, _, _ = run(tok, ids)
    assert deltas[0] == first.rstrip("\ufffd")


def test_incomplete_character_at_the_end_is_flushed_as_replacement_like_decode(tok):
    ids = byte_tokens(tok, "ok🚀")[:-1]  # the emoji never completes
    deltas, final, _ = run(tok, ids)
    assert "".join(deltas) == "ok" and final == "\ufffd" == tok.decode(ids)[2:]


def test_prompt_text_is_context_only(tok):
    deltas, final, detok = run(tok, tok.encode(" world").ids, prompt=tok.encode("Hello").ids)
    assert "".join(deltas) + final == " world" == detok.output_text


def test_metaspace_decoder_keeps_the_leading_space_of_the_first_output_token():
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    sp = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    sp.decoder = decoders.Metaspace()
    assert sp.decode([2]) == "world"  # decoded alone, the first token loses its space
    detok = IncrementalDetokenizer(sp, [1], SamplingParams())
    assert [detok.update([2]), detok.update([3]), detok.finish()] == [" world", "!", ""]


def test_byte_fallback_decoder_split_character_is_held_whole():
    # Llama-2 / Mistral style: SentencePiece byte-fallback tokens decode an incomplete character to
    # one U+FFFD *per byte*, so all trailing replacement characters must be held, not just one.
    vocab = {"<unk>": 0, "▁Hi": 1, "▁there": 2, "!": 3} | {f"<0x{b:02X}>": 4 + b for b in range(256)}
    sp = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    sp.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    zhong = [4 + b for b in "中".encode()]
    assert sp.decode([1, 3, *zhong[:2]]) == "Hi!\ufffd\ufffd"  # the premise
    detok = IncrementalDetokenizer(sp, [1], SamplingParams())
    deltas = [detok.update([t]) for t in [2, 3, *zhong, 3]]
    assert deltas == [" there", "!", "", "", "中", "!"] and detok.finish() == ""


def test_special_tokens_are_skipped_by_default(tok):
    eos = tok.token_to_id(EOS_TEXT)
    ids = [*tok.encode("ab").ids, eos, *tok.encode("cd").ids]
    deltas, final, _ = run(tok, ids, params=SamplingParams(ignore_eos=True), eos=eos)
    assert "".join(deltas) + final == "abcd"
    deltas, final, _ = run(tok, ids, params=SamplingParams(ignore_eos=True), eos=eos, skip_special_tokens=False)
    assert "".join(deltas) + final == f"ab{EOS_TEXT}cd"


# --- stop strings ---------------------------------------------------------------------------


def test_stop_string_split_across_tokens_is_held_and_truncated(tok):
    params = SamplingParams(stop=("STOP",))
    deltas, final, detok = run(tok, byte_tokens(tok, "Go STOP now"), params=params)
    assert deltas[:3] == ["G", "o", " "]
    assert deltas[3:] == [""] * (len(deltas) - 3)  # "S", "ST", "STO" held; nothing after the match
    assert final == "" and detok.matched_stop == "STOP" and detok.output_text == "Go "


def test_stop_string_inside_one_token_truncates_before_it(tok):
    ids = tok.encode("Go STOP signs").ids
    assert "STOP" in [tok.decode([i]) for i in ids]
    deltas, final, detok = run(tok, ids, params=SamplingParams(stop=("STOP",)))
    assert "".join(deltas) + final == "Go " and detok.matched_stop == "STOP"


def test_text_that_looked_like_a_stop_prefix_is_emitted_once_it_cannot_match(tok):
    params = SamplingParams(stop=("STOP",))
    deltas, final, detok = run(tok, byte_tokens(tok, "STAR!"), params=params)
    assert deltas[:5] == ["", "", "STA", "R", "!"]
    assert final == "" and detok.matched_stop is None


def test_held_stop_prefix_is_flushed_when_the_request_ends_otherwise(tok):
    params = SamplingParams(stop=("STOP",))
    deltas, final, detok = run(tok, byte_tokens(tok, "abc ST"), params=params)
    assert "".join(deltas) == "abc " and final == "ST" and detok.matched_stop is None


def test_overlapping_stop_prefixes_release_only_what_can_no_longer_match(tok):
    params = SamplingParams(stop=("aab",))
    deltas, final, detok = run(tok, byte_tokens(tok, "aaab"), params=params)
    assert deltas[:4] == ["", "", "a", ""]
    assert detok.output_text == "a" and detok.matched_stop == "aab" and final == ""


def test_earliest_stop_string_in_the_text_wins(tok):
    ids = tok.encode("xyz").ids
    params = SamplingParams(stop=("yz", "xy"))
    _, _, detok = run(tok, ids, params=params, chunks=[len(ids)])
    assert detok.matched_stop == "xy" and detok.output_text == ""


def test_multibyte_stop_string_matches_once_the_character_completes(tok):
    params = SamplingParams(stop=("中文",))
    deltas, final, detok = run(tok, byte_tokens(tok, "ab中文cd"), params=params)
    assert "".join(deltas) + final == "ab" and detok.matched_stop == "中文"


def test_stop_strings_do_not_match_inside_the_first_min_tokens_tokens(tok):
    params = SamplingParams(stop=("STOP",), min_tokens=4, max_tokens=20)
    deltas, final, detok = run(tok, byte_tokens(tok, "STOP STOP!"), params=params)
    assert "".join(deltas) + final == "STOP " and detok.matched_stop == "STOP"


def test_update_after_a_stop_string_returns_nothing(tok):
    detok = IncrementalDetokenizer(tok, [1], SamplingParams(stop=("ab",)))
    assert detok.update(byte_tokens(tok, "xab")) == "x"
    assert detok.update(byte_tokens(tok, "more")) == "" and detok.finish() == "" and detok.finish() == ""


@SETTINGS
@given(text=st.text(alphabet="abST中 ", max_size=20), stop=st.sampled_from(["ST", "aba", "中 ", "b"]))
def test_stop_string_output_is_the_decode_up_to_the_first_match(tok, text, stop):
    ids = byte_tokens(tok, text)
    deltas, final, detok = run(tok, ids, params=SamplingParams(stop=(stop,)))
    pos = text.find(stop)
    expected = text if pos == -1 else text[:pos]
    assert "".join(deltas) + final == expected == detok.output_text
    assert detok.matched_stop == (None if pos == -1 else stop)


# --- check_stop and the per-step flow --------------------------------------------------------


EOS = 0


@pytest.mark.parametrize(
    ("output", "params", "max_tokens", "stop_str", "expected"),
    [
        ([5, 6], SamplingParams(), 16, None, (False, None, None)),
        ([5, EOS], SamplingParams(), 16, None, (True, FinishReason.STOP, EOS)),
        ([5, EOS], SamplingParams(), 2, None, (True, FinishReason.STOP, EOS)),  # EOS beats length
        ([5, EOS], SamplingParams(ignore_eos=True), 16, None, (False, None, None)),
        ([5, EOS], SamplingParams(min_tokens=3), 16, None, (False, None, None)),
        ([5, 6, EOS], SamplingParams(min_tokens=3), 16, None, (True, FinishReason.STOP, EOS)),
        ([5, 9], SamplingParams(stop_token_ids=(9,)), 2, None, (True, FinishReason.STOP, 9)),
        ([9], SamplingParams(stop_token_ids=(9,), min_tokens=2), 16, None, (False, None, None)),
        ([EOS], SamplingParams(stop_token_ids=(EOS,), ignore_eos=True), 16, None, (True, FinishReason.STOP, EOS)),
        ([5, 6], SamplingParams(stop=("x",)), 2, "x", (True, FinishReason.STOP, "x")),  # beats length
        ([5, 6], SamplingParams(), 2, None, (True, FinishReason.LENGTH, None)),
        ([], SamplingParams(), 1, None, (False, None, None)),
    ],
)
def test_check_stop_order(output, params, max_tokens, stop_str, expected):
    result = check_stop(output, params, eos_token_id=EOS, max_tokens=max_tokens, matched_stop_str=stop_str)
    assert isinstance(result, StopCheck)
    finished, reason, matched = result
    assert (finished, reason, matched) == expected


def test_check_stop_without_eos_id_only_stops_on_length():
    assert check_stop([0, 0], SamplingParams(), eos_token_id=None, max_tokens=5) == (False, None, None)


def _generate(tok, script, params, max_tokens, eos):
    """The engine's per-step flow from replica/engine/stop.py, driven by a scripted token list."""
    detok = IncrementalDetokenizer(tok, tok.encode("Q: ").ids, params, eos_token_id=eos)
    output, text = [], ""
    for token in script:
        output.append(token)
        text += detok.update([token])
        result = check_stop(output, params, eos_token_id=eos, max_tokens=max_tokens,
                            matched_stop_str=detok.matched_stop)
        if result.finished:
            return text + detok.finish(), result, output
    raise AssertionError("script ran out before the request finished")


def test_flow_eos_text_is_not_emitted_and_held_text_is_flushed(tok):
    eos = tok.token_to_id(EOS_TEXT)
    script = [*byte_tokens(tok, "hi ST"), eos, 5]
    text, result, output = _generate(tok, script, SamplingParams(stop=("STOP",)), 16, eos)
    assert (text, result, output[-1]) == ("hi ST", (True, FinishReason.STOP, eos), eos)


def test_flow_stop_token_text_is_not_emitted(tok):
    newline = byte_tokens(tok, "\n")[0]
    script = [*byte_tokens(tok, "line one"), newline, 5]
    text, result, _ = _generate(tok, script, SamplingParams(stop_token_ids=(newline,)), 16, None)
    assert (text, result) == ("line one", (True, FinishReason.STOP, newline))


def test_flow_length_finish_flushes_a_split_character_and_a_stop_prefix(tok):
    script = byte_tokens(tok, "ab END")[:5]  # "ab EN"
    text, result, _ = _generate(tok, script, SamplingParams(stop=("END",)), 5, None)
    assert (text, result) == ("ab EN", (True, FinishReason.LENGTH, None))


def test_flow_stop_string_completed_by_the_last_allowed_token_reports_stop(tok):
    script = byte_tokens(tok, "ab END")
    text, result, _ = _generate(tok, script, SamplingParams(stop=("END",)), len(script), None)
    assert (text, result) == ("ab ", (True, FinishReason.STOP, "END"))


def test_check_stop_accepts_several_eos_ids():
    params = SamplingParams()
    assert check_stop([5, 7], params, eos_token_id=(0, 7), max_tokens=16) == (True, FinishReason.STOP, 7)
    assert check_stop([5, 6], params, eos_token_id=(0, 7), max_tokens=16) == (False, None, None)
