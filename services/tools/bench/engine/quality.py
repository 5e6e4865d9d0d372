"""The int8 quality gate: int8 against fp32 on a fixed prompt set and a fixed text.

- Greedy agreement, teacher-forced: along fp32's greedy continuation of each prompt, the
  share of positions where int8's argmax is fp32's token. Free-running, the first
  difference changes everything after it, so the identical prefix is reported too.
- Perplexity on quality_text.txt (public-domain prose and some code), each engine
  scoring every position itself (LLMEngine.prompt_logprobs).
The gate passes when perplexity is within 2% of fp32's and agreement at least 90%.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from shared.engine.llm_engine import LLMEngine
from shared.engine.params import SamplingParams

TEXT = Path(__file__).parent / "quality_text.txt"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the moon.",
    "Explain in one sentence what a KV cache is.",
    "def fibonacci(n):",
    "Give me a recipe for pancakes.",
    "Who wrote Pride and Prejudice?",
    "Name the planets of the solar system in order.",
    "Why is the sky blue?",
]
PPL_RATIO_MAX = 1.02
AGREEMENT_MIN = 0.90


def greedy(engine: LLMEngine, prompt: list[int], n: int, tag: str) -> list[int]:
    engine.add_request(tag, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    out: list[int] = []
    while engine.has_work():
        for o in engine.step():
            out.extend(o.new_token_ids)
    return out


def perplexity(engine: LLMEngine, ids: list[int]) -> float:
    return math.exp(-float(engine.prompt_logprobs(ids).token_logprobs.mean()))


def gate(
    reference: LLMEngine, candidate: LLMEngine, tokenizer: Any, new_tokens: int = 32
) -> dict[str, Any]:
    agree = total = prefix = 0
    for i, text in enumerate(PROMPTS):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )["input_ids"]
        ref = greedy(reference, prompt, new_tokens, f"q-ref{i}")
        free = greedy(candidate, prompt, new_tokens, f"q-cand{i}")
        prefix += next((j for j, (a, b) in enumerate(zip(ref, free)) if a != b), len(ref))
        # teacher-forced: candidate's argmax at each of fp32's positions, in one pass
        top = candidate.prompt_logprobs(prompt + ref, top_k=1).top_ids[len(prompt) - 1 :, 0]
        agree += sum(int(a == b) for a, b in zip(top.tolist(), ref))
        total += len(ref)
    ids = tokenizer(TEXT.read_text())["input_ids"]
    ppl_ref, ppl = perplexity(reference, ids), perplexity(candidate, ids)
    agreement = agree / total
    return {
        "prompts": len(PROMPTS),
        "tokens": total,
        "agreement": agreement,
        "identical_prefix": prefix / total,
        "text_tokens": len(ids),
        "ppl_reference": ppl_ref,
        "ppl": ppl,
        "ppl_ratio": ppl / ppl_ref,
        "passed": ppl / ppl_ref <= PPL_RATIO_MAX and agreement >= AGREEMENT_MIN,
    }
