"""GGUF files written by the tests, with the `gguf` package as llama.cpp's converter writes
them: a random-weight Qwen2 model (tensors named by gguf's own name map, its projections
quantized to Q8_0), with the default model's BPE tokenizer and chat template, so that
`halfmoon model import` has a real quantized GGUF to convert and the stack can chat with
the result. No model download: the tokenizer comes from the model folder the tests use.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen2Config

QUANTIZED = "proj.weight"  # the attention and MLP projections: Q8_0; the rest F32


def tiny_qwen2(vocab: int, seed: int = 0) -> PreTrainedModel:
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        initializer_range=0.05,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def write_qwen2_gguf(path: Path, tokenizer_dir: Path, arch: str = "qwen2") -> dict[str, np.ndarray]:
    """Writes the GGUF; returns each HF tensor as a GGUF reader will dequantize it. `arch`
    other than qwen2 names another architecture in the header (to test a refusal)."""
    tj = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    vocab: dict[str, int] = tj["model"]["vocab"]
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    special = {a["id"] for a in tj["added_tokens"] if a.get("special")}
    model = tiny_qwen2(len(tokens))
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-qwen2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(
        [
            gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
            for i in range(len(tokens))
        ]
    )
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]])
    w.add_bos_token_id(tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_chat_template(tok.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, c.num_hidden_layers)
    expected: dict[str, np.ndarray] = {}
    for key, tensor in model.state_dict().items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        data = tensor.float().numpy()
        if key.endswith(QUANTIZED):
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            expected[key] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data)
            expected[key] = data
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected
