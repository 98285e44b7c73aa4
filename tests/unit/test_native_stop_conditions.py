"""Stop strings, stop tokens, min_tokens and prompt limits in the native engine, as vLLM's backend has them."""

import pytest
from pydantic import ValidationError

from arctic_rl_core.engines.sampling.native import NativeEngine
from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams

PROMPT = [100, 200, 300]
GREEDY = dict(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model):
    engine = NativeEngine(tiny_model, SamplingEngineOptions(max_model_len=64, max_num_seqs=8, block_size=4))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def free(engine):
    return engine.generate([PROMPT], SamplingParams(**GREEDY))[0][0]


def _tokens_ending(engine, token_ids, stop):
    """Indices of the tokens whose text completes an occurrence of ``stop``."""
    texts = [engine._decode(token_ids[: i + 1]) for i in range(len(token_ids))]
    return [i for i, text in enumerate(texts) if text.count(stop) > (texts[i - 1].count(stop) if i else 0)]


def _letter_seen_three_times(engine, free):
    return next(
        c for c in sorted(set(free.text)) if c.isalpha() and len(_tokens_ending(engine, free.token_ids, c)) >= 3
    )


def test_an_empty_stop_string_is_rejected_by_name():
    with pytest.raises(ValidationError, match="stop"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValidationError, match="stop"):
        SamplingParams(stop="")


def test_a_stop_string_ignored_under_min_tokens_does_not_hide_its_later_occurrences(engine, free):
    stop = _letter_seen_three_times(engine, free)
    ends = _tokens_ending(engine, free.token_ids, stop)
    params = SamplingParams(**GREEDY, stop=[stop], min_tokens=ends[0] + 1)
    # A second, longer stop string that never occurs must not change where the first one stops.
    for stops in ([stop], [stop, "Q" * 64]):
        out = engine.generate([PROMPT], params.model_copy(update={"stop": stops}))[0][0]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert out.token_ids == free.token_ids[: ends[1] + 1]


def test_the_first_min_tokens_tokens_never_end_the_completion_by_a_stop_string(engine, free):
    stop = _letter_seen_three_times(engine, free)
    ends = _tokens_ending(engine, free.token_ids, stop)
    # Token ends[1] + 1 is the min_tokens-th: the occurrence it completes is ignored, as vLLM ignores it.
    out = engine.generate([PROMPT], SamplingParams(**GREEDY, stop=[stop], min_tokens=ends[1] + 1))[0][0]
    assert out.token_ids == free.token_ids[: ends[2] + 1]
    assert len(out.token_ids) > ends[1] + 1


def test_a_stop_token_is_returned_in_token_ids_but_left_out_of_the_text(engine, free):
    k = next(i for i in range(2, len(free.token_ids)) if engine._decode(free.token_ids[i : i + 1]).strip())
    stop_id = free.token_ids[k]
    out = engine.generate([PROMPT], SamplingParams(**GREEDY, stop_token_ids=[stop_id]))[0][0]
    first = free.token_ids.index(stop_id)
    assert out.token_ids == free.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.text == engine._decode(free.token_ids[:first])


def test_a_prompt_without_room_to_generate_is_rejected_naming_the_field_and_the_limit(engine):
    with pytest.raises(ValueError, match=r"prompt_token_ids has 64 tokens; expected at most 63.*max_model_len=64"):
        engine.add_request([5] * 64, SamplingParams())
    assert engine.generate([[5] * 63], SamplingParams(max_tokens=4))[0][0].finish_reason == "length"


def test_the_text_leaves_out_a_trailing_incomplete_utf8_sequence_as_vllms_detokenizer_does(engine):
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for prompt in ([5 + i, 100 + 7 * i, 300 + 11 * i, 50 + i] for i in range(24)):
        free = engine.generate([prompt], greedy)[0][0]
        cuts = [k for k in range(1, 11) if engine._decode(free.token_ids[:k]).endswith("\ufffd")]
        if cuts:
            break
    else:
        pytest.fail("no greedy completion ends a token in the middle of a UTF-8 sequence")
    cut = engine.generate([prompt], greedy.model_copy(update={"max_tokens": cuts[0]}))[0][0]
    assert cut.token_ids == free.token_ids[: cuts[0]]
    held_back = next(k for k in range(cuts[0], -1, -1) if not engine._decode(free.token_ids[:k]).endswith("\ufffd"))
    assert cut.text == engine._decode(free.token_ids[:held_back])
    assert free.text.startswith(cut.text) and not cut.text.endswith("\ufffd")


def test_of_stop_strings_one_token_completes_the_one_ending_first_wins_then_the_first_listed(engine, free):
    texts = [engine._decode(free.token_ids[: i + 1]) for i in range(len(free.token_ids))]

    def first_ends_in_token(k, stop):
        return len(texts[k - 1]) < texts[k].find(stop) + len(stop) <= len(texts[k]) and texts[k].find(stop) >= 0

    k = next(
        k
        for k in range(1, len(texts))
        if all(texts[j + 1].startswith(texts[j]) for j in range(k))
        and len(new := texts[k][len(texts[k - 1]) :]) >= 3
        and all(first_ends_in_token(k, s) for s in (new, new[1:], new[1:-1]))
    )
    before, new = texts[k - 1], texts[k][len(texts[k - 1]) :]
    for stops, want in (([new, new[1:-1]], new[1:-1]), ([new[1:], new], new[1:]), ([new, new[1:]], new)):
        out = engine.generate([PROMPT], SamplingParams(**GREEDY, stop=stops))[0][0]
        assert out.token_ids == free.token_ids[: k + 1]
        assert (out.finish_reason, out.stop_reason, out.text) == ("stop", want, (before + new)[: texts[k].find(want)])
