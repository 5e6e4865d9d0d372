"""`halfmoon bench structured`: what structured output costs the requests beside it.

One engine, the same prompts and batch size twice: every request unconstrained, then a
share of them constrained by JSON schemas (the rest unchanged). The figure is the
unconstrained requests' decode rate (tokens per second per request, over the steps with
the whole batch running) in the mixed batch against the unmixed one: grammar masks are
computed only for the rows that have one, so it should stay within 10%. Every
constrained output is also checked against its schema.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Sequence

import torch

from services.tools.bench.schemas import SCHEMAS
from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import Constraint, SamplingParams
from shared.engine.runner import load_model
from shared.model_store import ensure_model


def prompts(lm: Any, n: int) -> list[list[int]]:
    return [
        lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Tell me about item {i} in a few sentences, as JSON."}],
            add_generation_prompt=True,
        )["input_ids"]
        for i in range(n)
    ]


def run(engine: LLMEngine, batch: list[tuple[str, list[int], SamplingParams]]) -> dict[str, Any]:
    """Run one batch to the end: every request's text, and the wall time of each decode
    step of the whole batch, in order (the steps before any request finished)."""
    for rid, prompt, params in batch:
        engine.add_request(rid, prompt, params)
    text: dict[str, str] = {rid: "" for rid, _, _ in batch}
    full_steps: list[float] = []
    while engine.has_work():
        t0 = time.perf_counter()
        outs = engine.step()
        st = engine.last_step
        if st.num_tokens == st.num_seqs == len(batch):  # a decode step of the whole batch
            full_steps.append(time.perf_counter() - t0)
        for o in outs:
            text[o.request_id] += o.text
    return {"text": text, "full_steps": full_steps}


def mixed_batch(
    ps: list[list[int]], constrained: int, free: SamplingParams, tag: str
) -> list[tuple[str, list[int], SamplingParams]]:
    """The first `constrained` prompts under the JSON schemas (sampled, room for twice
    the tokens), the rest with the unmixed batch's `free` params."""
    out = []
    for i, p_ in enumerate(ps):
        if i < constrained:
            schema = json.dumps(SCHEMAS[i % len(SCHEMAS)])
            params = SamplingParams(
                temperature=0.8,
                seed=i,
                max_tokens=free.max_tokens * 2,
                constraint=Constraint("json_schema", schema),
            )
            out.append((f"c{tag}-{i}", p_, params))
        else:
            out.append((f"m{tag}-{i}", p_, free))
    return out


def valid_answers(text: dict[str, str], tag: str, constrained: int) -> int:
    """How many of a mixed batch's constrained answers parse and match their schema."""
    import jsonschema

    valid = 0
    for i in range(constrained):
        try:
            schema = SCHEMAS[i % len(SCHEMAS)]
            jsonschema.validate(json.loads(text[f"c{tag}-{i}"]), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return valid


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="halfmoon bench structured",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--batch", type=int, default=16, help="requests per batch")
    p.add_argument("--constrained", type=int, default=4, help="of which constrained")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="unmixed then mixed batches, this many times in turn (the machine's noise "
        "moves both alike within a round)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    lm = load_model(ensure_model(args.model), args.dtype, "cpu", args.threads)
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=1 << 30))
    ps = prompts(lm, args.batch)
    free = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    run(engine, [(f"w{i}", ps[i], free) for i in range(2)])  # warm-up
    rounds, valid, checked = [], 0, 0
    for r in range(args.rounds):
        # Only the decode steps are timed, so prompts served from the prefix cache after
        # the first batch change nothing measured.
        plain = run(engine, [(f"u{r}-{i}", p_, free) for i, p_ in enumerate(ps)])
        mixed = run(engine, mixed_batch(ps, args.constrained, free, str(r)))
        # The same steps of both: the mixed batch is whole only until its first
        # constrained answer closes, and later steps read more KV.
        k = min(len(plain["full_steps"]), len(mixed["full_steps"]))
        plain_s = statistics.median(plain["full_steps"][:k])
        mixed_s = statistics.median(mixed["full_steps"][:k])
        rounds.append({"steps": k, "unmixed_step_s": plain_s, "mixed_step_s": mixed_s,
                       "ratio": plain_s / mixed_s})  # fmt: skip
        checked += args.constrained
        valid += valid_answers(mixed["text"], str(r), args.constrained)
    ratio = statistics.median(x["ratio"] for x in rounds)
    unmixed_tok_s = 1 / statistics.median(x["unmixed_step_s"] for x in rounds)
    mixed_tok_s = 1 / statistics.median(x["mixed_step_s"] for x in rounds)
    out = {
        "model": lm.name,
        "dtype": str(lm.dtype)[6:],
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "constrained": args.constrained,
        "rounds": rounds,
        "unmixed_per_request_tok_s": unmixed_tok_s,
        "mixed_per_request_tok_s": mixed_tok_s,
        "ratio": ratio,
        "constrained_valid": valid,
        "constrained_checked": checked,
    }
    print(json.dumps(out, indent=2))
    each = ", ".join(f"{x['ratio']:.3f}" for x in rounds)
    print(
        f"batch of {args.batch}, decode per unconstrained request: {unmixed_tok_s:.1f} tok/s "
        f"unmixed, {mixed_tok_s:.1f} tok/s with {args.constrained} constrained beside them "
        f"(median of {args.rounds} rounds' ratios over the same steps: {ratio:.3f}x; rounds "
        f"{each}); {valid}/{checked} constrained outputs valid",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
