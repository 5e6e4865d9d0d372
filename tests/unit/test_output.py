"""OutputTracker: detokenization and stop conditions with a toy character tokenizer."""

from shared.engine.output import FullDecodeDetokenizer, OutputTracker, StreamDetokenizer
from shared.engine.params import SamplingParams
from shared.messages import FinishReason

VOCAB = {i: ch for i, ch in enumerate("abcdefghijklmnopqrstuvwxyz .!")}
EOS = 99


def decode(ids):
    return "".join(VOCAB.get(i, "") for i in ids)


def ids(text):
    inv = {v: k for k, v in VOCAB.items()}
    return [inv[c] for c in text]


def tracker(prefix=(), emitted="", **params):
    return OutputTracker(
        SamplingParams(**params),
        FullDecodeDetokenizer(decode, list(prefix)),
        frozenset({EOS}),
        prompt_len=10,
        max_model_len=1000,
        token_ids=list(prefix),
        text=decode(list(prefix)),
        emitted_text=emitted,
    )


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
    t = OutputTracker(
        SamplingParams(max_tokens=100),
        FullDecodeDetokenizer(decode, []),
        frozenset(),
        prompt_len=997,
        max_model_len=1000,
    )
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
    assert feed(t, ids("a ended")[:4] + ids("x") + [EOS]) == ("a enx", FinishReason.STOP)


def test_stop_token_ids():
    t = tracker(max_tokens=50, stop_token_ids=[ids(".")[0]])
    assert feed(t, ids("hi.there")) == ("hi", FinishReason.STOP)


def test_continuation_on_another_process_resumes_text():
    first = tracker(max_tokens=50)
    feed(first, ids("hel"))
    second = tracker(prefix=first.token_ids, emitted=first.emitted_text, max_tokens=50)
    assert feed(second, ids("lo") + [EOS]) == ("lo", FinishReason.STOP)


def test_held_stop_prefix_survives_the_move_to_another_process():
    first = tracker(max_tokens=50, stop=["end"])
    assert feed(first, ids("the en")) == ("the ", None)  # "en" held back
    second = tracker(
        prefix=first.token_ids, emitted=first.emitted_text, max_tokens=50, stop=["end"]
    )
    assert feed(second, ids("ds")) == ("", FinishReason.STOP)


def test_stream_detokenizer_matches_a_full_decode(tmp_path):
    """DecodeStream on a real byte-level BPE: multi-byte characters split over tokens come
    out whole, and the pieces add up to what decoding everything at once gives."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = "Héllo wörld, ça va? 日本語 🙂 ok. " * 3
    tok.train_from_iterator(
        [text],
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    token_ids = tok.encode(text).ids
    detok = StreamDetokenizer(tok, token_ids[:4])
    pieces = [detok.step(t) for t in token_ids[4:]]
    assert "\ufffd" not in "".join(pieces)
    assert tok.decode(token_ids[:4]) + "".join(pieces) == tok.decode(token_ids)
