"""A synthetic Mooncake trace with the paper's statistics (pure: seeded, no I/O).

Mooncake's FAST'25 paper evaluates on three workloads; its synthetic one is built from
public datasets (short chats, and long documents asked several questions each) and
arrives as a Poisson process. Its table gives: average input 15,325 tokens,
average output 149, cache ratio about 66%. The released file (3,993 requests over 17
minutes) is not shipped here, so this module generates a trace of that kind:

- arrivals: Poisson, 3.9 requests/s by default (the released trace's 3,993 in 1,022 s);
- 30% short chats: fresh prompts, lognormal input (median 67 tokens) and output (median
  175, the chats are the long answers);
- 70% document questions: a document of lognormal length (median 14k tokens), then a
  question of lognormal length (median 300). 69% of them ask about a document asked
  before, picked among the 100 most recent ones (documents are asked about in bursts);
  a repeat shares the document's whole blocks, its last partial block and the question
  are fresh. Answers are short (lognormal, median 28 tokens).

The mix and the spreads follow the released trace's histograms (its requests under 1,024
tokens are 30%, with median input 46 and output 252; the longer ones have a lognormal
input of sigma 0.95 and a median output of 27); the document median and the repeat share
were then set so that five seeds average the paper's figures: input 15,264 tokens, output
152, ideal prefix hit ratio 66.3% (the released file's is 65.1%). tests/unit/
test_synthetic.py checks each seed against the paper's three averages. Hash ids number
blocks of `block_tokens` tokens in order of first use, as in the released traces.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass, replace
from typing import Any, Sequence, TypeVar

from services.kvmanager.hot_prefix import HotPrefixShape, hot_prefix_trace, hot_requests
from services.kvmanager.phase_shift import PhaseShape, phase_shift_trace
from services.kvmanager.traces import FreshIds, TraceRequest, write_trace

# The paper's table (Mooncake, FAST'25, §5.1): what a generated trace must reproduce.
PAPER_MEAN_INPUT = 15_325
PAPER_MEAN_OUTPUT = 149
PAPER_CACHE_RATIO = 0.66


@dataclass(frozen=True)
class SyntheticShape:
    requests: int = 3_993
    rate_per_s: float = 3.9
    chat_share: float = 0.30
    chat_input: tuple[float, float] = (4.21, 1.18)  # lognormal (mu, sigma) of tokens
    chat_output: tuple[float, float] = (5.17, 1.24)
    document: tuple[float, float] = (9.55, 0.95)
    question: tuple[float, float] = (5.7, 0.9)
    doc_output: tuple[float, float] = (3.33, 1.69)
    repeat_share: float = 0.69  # of document questions: about a document asked before
    recent_documents: int = 100  # a repeat picks among this many latest documents
    max_input: int = 192_000
    max_output: int = 900
    block_tokens: int = 512
    min_document: int = 1_024


# Long documents (issue 29's workload for pipelined prefill): documents of 8k-32k tokens
# (median 16k), each asked about about five times in bursts (80% of the questions are
# about one of the 20 latest documents), no chats; Poisson arrivals as in the paper, at a
# rate that keeps 16 prefill instances of the paper's setting about half busy.
LONG_DOCUMENTS = SyntheticShape(
    requests=2_000,
    rate_per_s=2.0,
    chat_share=0.0,
    document=(math.log(16_000), 0.45),
    repeat_share=0.8,
    recent_documents=20,
    max_input=32_768,
    min_document=8_192,
)
SHAPES = {"mooncake": SyntheticShape(), "long-documents": LONG_DOCUMENTS}


def _lognormal(rng: random.Random, shape: tuple[float, float], lo: int, hi: int) -> int:
    return min(hi, max(lo, round(math.exp(rng.gauss(*shape)))))


def synthetic_trace(shape: SyntheticShape = SyntheticShape(), seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    bt = shape.block_tokens
    fresh = FreshIds().take
    documents: list[tuple[int, list[int]]] = []  # (tokens, ids of its whole blocks)

    out: list[TraceRequest] = []
    t = 0.0
    for _ in range(shape.requests):
        t += rng.expovariate(shape.rate_per_s)
        if rng.random() < shape.chat_share:
            n = _lognormal(rng, shape.chat_input, 8, bt * 2 - 1)
            o = _lognormal(rng, shape.chat_output, 1, shape.max_output)
            out.append(TraceRequest(round(t * 1000), n, o, fresh(-(-n // bt))))
            continue
        if documents and rng.random() < shape.repeat_share:
            doc_tokens, doc_ids = rng.choice(documents[-shape.recent_documents :])
        else:
            doc_tokens = _lognormal(rng, shape.document, shape.min_document, shape.max_input)
            doc_ids = fresh(doc_tokens // bt)
            documents.append((doc_tokens, doc_ids))
        q = _lognormal(rng, shape.question, 4, bt * 8)
        n = min(shape.max_input, doc_tokens + q)
        rest = -(-(n - len(doc_ids) * bt) // bt)  # the partial block and the question
        o = _lognormal(rng, shape.doc_output, 1, shape.max_output)
        out.append(TraceRequest(round(t * 1000), n, o, doc_ids + fresh(rest)))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="halfmoon kv synth",
        description="Write a synthetic Mooncake trace with the paper's statistics (average "
        "input 15,325 tokens, output 149, cache ratio ~66%%, Poisson arrivals).",
    )
    p.add_argument("--out", required=True, help="JSONL file to write")
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="mooncake",
        help="mooncake: the paper's synthetic mix; long-documents: 8k-32k-token documents "
        "asked about several times each, no chats (%(default)s)",
    )
    other = p.add_mutually_exclusive_group()
    other.add_argument(
        "--shift",
        action="store_true",
        help="instead: the phase-shifting workload (phase_shift.py): a prompt-heavy first "
        "half (documents, short answers), an output-heavy second half (chats, long "
        "answers), Poisson at one rate, every request fresh (for `halfmoon plan`)",
    )
    other.add_argument(
        "--hot",
        action="store_true",
        help="instead: the skewed hot-prefix workload (hot_prefix.py): Poisson arrivals, a "
        "share of the requests starting with one shared prefix, the rest fresh prompts of "
        "the same length (for hot-prefix replication)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (%(default)s)")
    p.add_argument("--requests", type=int, help="requests (default: the shape's)")
    p.add_argument("--rate", type=float, help="arrivals per second (default: the shape's)")
    _add_hot_args(p)
    return p


# --hot's flags: HotPrefixShape's fields, (flag, type, help); each defaults to the shape's.
_HOT_FLAGS = (
    ("--hot-share", float, "share of requests that start with the hot prefix"),
    ("--hot-prefix-tokens", int, "tokens of the hot prefix, whole 512-token blocks"),
    ("--own-tokens", int, "tokens of each request's own fresh suffix"),
    ("--output-tokens", int, "output tokens of every request"),
    ("--hot-start-s", float, "seconds before which only --warm-share start with the prefix"),
    ("--warm-share", float, "share of requests with the prefix before --hot-start-s"),
    ("--fresh-tokens", int, "tokens of the other requests (0: as long as the hot ones)"),
)


def _add_hot_args(p: argparse.ArgumentParser) -> None:
    defaults = HotPrefixShape()
    for flag, kind, text in _HOT_FLAGS:
        default = getattr(defaults, _field(flag))
        note = f"with --hot: {text} ({default})"
        p.add_argument(flag, type=kind, metavar=kind.__name__.upper(), help=note)


_Shape = TypeVar("_Shape", SyntheticShape, PhaseShape)


def _sized(base: _Shape, args: argparse.Namespace) -> _Shape:
    """The shape with --requests and --rate where given."""
    return replace(
        base,
        requests=base.requests if args.requests is None else args.requests,
        rate_per_s=base.rate_per_s if args.rate is None else args.rate,
    )


def main(argv: Sequence[str] | None = None) -> int:
    from services.kvmanager.replay import replay_requests

    args = build_parser().parse_args(argv)
    if args.shift:
        return _shift(args)
    if args.hot:
        return _hot(args)
    given = [flag for flag, _, _ in _HOT_FLAGS if getattr(args, _field(flag)) is not None]
    if given:
        print(f"halfmoon kv synth: {', '.join(given)}: only with --hot")
        return 2
    shape = _sized(SHAPES[args.shape], args)
    if shape.requests < 1 or not shape.rate_per_s > 0:
        print("halfmoon kv synth: --requests must be >= 1 and --rate > 0")
        return 2
    trace = synthetic_trace(shape, args.seed)
    write_trace(args.out, trace)
    hit = replay_requests(trace, None).hit_ratio
    paper = args.shape == "mooncake"  # the shape made to match the paper's table

    def vs(text: str) -> str:
        return f" ({text})" if paper else ""

    print(
        f"{args.out}: {len(trace)} requests over {trace[-1].timestamp_ms / 1e3:.0f} s, mean "
        f"input {statistics.mean(r.input_length for r in trace):,.0f} tokens"
        f"{vs(f'paper {PAPER_MEAN_INPUT:,}')}, output "
        f"{statistics.mean(r.output_length for r in trace):.0f}{vs(str(PAPER_MEAN_OUTPUT))}, "
        f"ideal prefix hit ratio {hit:.1%}{vs(f'~{PAPER_CACHE_RATIO:.0%}')}"
    )
    return 0


def _shift(args: argparse.Namespace) -> int:
    shape = _sized(PhaseShape(), args)
    if shape.requests < 2 or not shape.rate_per_s > 0:
        print("halfmoon kv synth: --shift needs --requests >= 2 and --rate > 0")
        return 2
    trace = phase_shift_trace(shape, args.seed)
    write_trace(args.out, trace)
    half = len(trace) // 2
    for name, part in (("documents", trace[:half]), ("chats", trace[half:])):
        span = (part[-1].timestamp_ms - part[0].timestamp_ms) / 1e3
        print(
            f"{args.out} {name}: {len(part)} requests over {span:.0f} s, mean input "
            f"{statistics.mean(r.input_length for r in part):,.0f} tokens, output "
            f"{statistics.mean(r.output_length for r in part):,.0f}"
        )
    return 0


def _field(flag: str) -> str:
    """The shape's field (and the Namespace's attribute) a flag sets: --hot-share, hot_share."""
    return flag[2:].replace("-", "_")


def _hot(args: argparse.Namespace) -> int:
    from services.kvmanager.replay import replay_requests

    fields: dict[str, Any] = {"requests": args.requests, "rate": args.rate}
    fields.update((_field(flag), getattr(args, _field(flag))) for flag, _, _ in _HOT_FLAGS)
    try:
        shape = HotPrefixShape(**{k: v for k, v in fields.items() if v is not None})
    except ValueError as e:
        print(f"halfmoon kv synth: --hot: {e}")
        return 2
    trace = hot_prefix_trace(shape, args.seed)
    write_trace(args.out, trace)
    hit = replay_requests(trace, None, block_tokens=shape.block_tokens).hit_ratio
    start = f" from {shape.hot_start_s:g} s" if shape.hot_start_s else ""
    print(
        f"{args.out}: {len(trace)} requests over {trace[-1].timestamp_ms / 1e3:.0f} s, "
        f"{hot_requests(trace) / len(trace):.1%} with the hot prefix (asked "
        f"{shape.hot_share:.0%}{start}), ideal prefix hit ratio {hit:.1%}"
    )
    return 0
