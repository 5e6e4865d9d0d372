"""OutputTracker: detokenization and stop conditions with a toy character tokenizer."""

from shared.engine.output import OutputTracker
from shared.messages import FinishReason, SamplingParams

VOCAB = {i: ch for i, ch in enumerate("abcdefghijklmnopqrstuvwxyz .!")}
EOS = 99


def decode(ids):
    return "".join(VOCAB.get(i, "") for i in ids)


def ids(text):
    inv = {v: k for k, v in VOCAB.items()}
    return [inv[c] for c in text]


def tracker(**params):
    return OutputTracker(SamplingParams(**params), decode, frozenset({EOS}), prompt_len=10,
                         max_model_len=1000)


def feed(t, tokens):
    out, reason = "", None
    for tok in tokens:
        step = t.append(tok)
        out += step.text
        reason = step.finish_reason
        if reason:
            break
    return out, reason


def test_eos_stops_and_is_not_text():
    t = tracker(max_tokens=50)
    assert feed(t, ids("hello") + [EOS]) == ("hello", FinishReason.STOP)
    assert t.completion_tokens == 6


def test_ignore_eos_keeps_going_to_length():
    t = tracker(max_tokens=3, ignore_eos=True)
    assert feed(t, [EOS, EOS, EOS])[1] == FinishReason.LENGTH


def test_max_tokens_is_length():
    t = tracker(max_tokens=4)
    assert feed(t, ids("abcdefg")) == ("abcd", FinishReason.LENGTH)


def test_context_limit_is_length():
    t = OutputTracker(SamplingParams(max_tokens=100), decode, frozenset(), prompt_len=997,
                      max_model_len=1000)
    assert feed(t, ids("abcdef")) == ("abc", FinishReason.LENGTH)


def test_stop_string_across_tokens_is_cut_and_never_streamed():
    t = tracker(max_tokens=50, stop=["end"])
    streamed = []
    for tok in ids("the end is near"):
        step = t.append(tok)
        streamed.append(step.text)
        if step.finish_reason:
            break
    assert "".join(streamed) == "the "
    assert t.finish_reason == FinishReason.STOP
    # the partial "e", "en" were held back, not sent and then retracted
    assert all("e" not in s for s in streamed[4:])


def test_held_text_is_released_when_stop_does_not_match():
    t = tracker(max_tokens=50, stop=["end"])
    assert feed(t, ids("a ended") [:4] + ids("x") + [EOS]) == ("a enx", FinishReason.STOP)


def test_stop_token_ids():
    t = tracker(max_tokens=50, stop_token_ids=[ids(".")[0]])
    assert feed(t, ids("hi.there")) == ("hi", FinishReason.STOP)


def test_continuation_on_another_process_resumes_text():
    first = tracker(max_tokens=50)
    feed(first, ids("hel"))
    second = tracker(max_tokens=50)
    second.token_ids, second.emitted_text = list(first.token_ids), first.emitted_text
    assert feed(second, ids("lo") + [EOS]) == ("lo", FinishReason.STOP)
