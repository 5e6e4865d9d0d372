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
import sys
import time
from typing import Any, Sequence

import torch

from shared.engine.llm_engine import EngineConfig, LLMEngine
from shared.engine.params import Constraint, SamplingParams
from shared.engine.runner import load_model
from shared.model_store import ensure_model

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "tags": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 12}},
        },
        "required": ["city", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "level": {"enum": ["low", "mid", "high"]},
            "score": {"type": "number"},
        },
        "required": ["ok", "level", "score"],
        "additionalProperties": False,
    },
]


def prompts(lm: Any, n: int) -> list[list[int]]:
    return [
        lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Tell me about item {i} in a few sentences, as JSON."}],
            add_generation_prompt=True,
        )["input_ids"]
        for i in range(n)
    ]


def run(engine: LLMEngine, batch: list[tuple[str, list[int], SamplingParams]]) -> dict[str, Any]:
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
    full_steps.sort()
    step = full_steps[len(full_steps) // 2] if full_steps else float("nan")
    return {
        "text": text,
        "step_p50_s": step,
        "per_request_tok_s": 1.0 / step,
        "full_steps": len(full_steps),
    }


def main(argv: Sequence[str] | None = None) -> int:
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
    args = p.parse_args(argv)
    import jsonschema

    lm = load_model(ensure_model(args.model), args.dtype, "cpu", args.threads)
    engine = LLMEngine(lm, EngineConfig(kv_cache_bytes=1 << 30))
    ps = prompts(lm, args.batch)
    free = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    run(engine, [(f"w{i}", ps[i], free) for i in range(2)])  # warm-up
    plain = run(engine, [(f"u{i}", p_, free) for i, p_ in enumerate(ps)])
    mixed_batch = []
    for i, p_ in enumerate(ps):
        if i < args.constrained:
            schema = SCHEMAS[i % len(SCHEMAS)]
            mixed_batch.append(
                (
                    f"c{i}",
                    p_,
                    SamplingParams(
                        temperature=0.8,
                        seed=i,
                        max_tokens=args.tokens * 2,
                        constraint=Constraint("json_schema", json.dumps(schema)),
                    ),
                )
            )
        else:
            mixed_batch.append((f"m{i}", p_, free))
    mixed = run(engine, mixed_batch)
    valid = 0
    for i in range(args.constrained):
        try:
            jsonschema.validate(json.loads(mixed["text"][f"c{i}"]), SCHEMAS[i % len(SCHEMAS)])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    ratio = mixed["per_request_tok_s"] / plain["per_request_tok_s"]
    out = {
        "model": lm.name,
        "dtype": str(lm.dtype)[6:],
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "constrained": args.constrained,
        "unmixed": {k: plain[k] for k in ("step_p50_s", "per_request_tok_s", "full_steps")},
        "mixed": {k: mixed[k] for k in ("step_p50_s", "per_request_tok_s", "full_steps")},
        "ratio": ratio,
        "constrained_valid": valid,
    }
    print(json.dumps(out, indent=2))
    print(
        f"batch of {args.batch}, decode per unconstrained request: "
        f"{plain['per_request_tok_s']:.1f} tok/s unmixed, {mixed['per_request_tok_s']:.1f} "
        f"tok/s with {args.constrained} constrained beside them ({ratio:.3f}x); "
        f"{valid}/{args.constrained} constrained outputs valid",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
