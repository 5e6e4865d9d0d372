"""`halfmoon bench request` without a stack: fresh prompts by default, never repeated and
sharing no KV block; the warm mode's prefix reuse mirrored in-process on the real model."""

from __future__ import annotations

from pathlib import Path

from services.tools.bench import request_latency as rl

BLOCK = 16  # the gateway's default KV block size (services/gateway/args.py)


def test_defaults_are_fresh():
    a = rl.parser().parse_args([])
    assert a.prompts == "fresh" and a.dtype == "auto" and a.runs == 5


def test_fresh_prompts_never_repeat_nor_share_a_block(model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompts = rl.run_prompts("fresh", "4f6e2428", "Why is the sky blue?", runs=5)
    assert len(prompts) == 6  # the warm-up has its own
    ids = [tok.apply_chat_template(m, add_generation_prompt=True)["input_ids"] for m in prompts]
    assert len({tuple(i[:BLOCK]) for i in ids}) == 6
    assert all(m[-1] == {"role": "user", "content": "Why is the sky blue?"} for m in prompts)
    assert rl.run_prompts("fresh", "other", "Why is the sky blue?", 5)[0] != prompts[0]


def test_warm_prompts_are_one_prompt():
    prompts = rl.run_prompts("warm", "4f6e2428", "Why?", runs=3)
    assert len(prompts) == 4 and all(p == prompts[0] for p in prompts)


def test_reuse_leaves_a_token_to_compute():
    assert rl.reused_tokens(0, 40) == 0
    assert rl.reused_tokens(32, 40) == 32
    assert rl.reused_tokens(48, 40) == 39


def test_the_baseline_reuses_what_the_stack_reported(model_dir: Path):
    prompts = rl.run_prompts("warm", "4f6e2428", "Why is the sky blue?", runs=1)
    rows = rl._inprocess(str(model_dir), "float32", 1, prompts, cached=[0, 16], max_tokens=2)
    assert [r["reused_tokens"] for r in rows] == [0, 16]
    assert all(r["ttft_s"] > 0 and r["total_s"] > 0 for r in rows)


def test_table_shows_what_each_side_reused():
    side = {"ttft_ms": 50.0, "total_ms": 700.0, "reused_tokens": 48}
    text = rl.render(
        {
            "prompt_tokens": 49,
            "max_tokens": 16,
            "runs": 3,
            "dtype": "bfloat16",
            "prompts": "warm",
            "prompts_meaning": rl.PROMPT_MODES["warm"],
            "threads": 1,
            "stack": side,
            "in_process": side,
        }
    )
    assert "prompts warm: the same prompt" in text and "1 torch thread;" in text
    assert text.splitlines()[-1].split() == ["in_process", "50.0", "700.0", "48"]
