"""Logprobs in OpenAI's shapes: chat's `logprobs.content` and the legacy completions'
`tokens` / `token_logprobs` / `top_logprobs` / `text_offset`.

A token's string and bytes come from the tokenizer: for byte-level BPE (GPT-2 style, the
default model's) the exact bytes a token stands for, so `bytes` is right even for a token
that holds half of a multi-byte character; its `token` is then OpenAI's `bytes:\\xNN`
form. Other tokenizers: the token decoded alone.
"""

from __future__ import annotations

import functools
from typing import Any

from shared.messages import TokenLogprob


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the printable stand-in for each byte."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenTexts:
    """Token id -> (string, UTF-8 bytes), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.of = functools.lru_cache(maxsize=65536)(self._of)

    def _of(self, token_id: int) -> tuple[str, list[int]]:
        if self.byte_level and token_id not in self.special:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                table = _byte_decoder()
                raw = b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)
                return _as_text(raw), list(raw)
        text = self.tokenizer.decode([token_id])
        return text, list(text.encode("utf-8"))


def _as_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_entries(texts: TokenTexts, lps: list[TokenLogprob], top_k: int) -> list[dict[str, Any]]:
    """`logprobs.content` entries, one per token."""
    out = []
    for lp in lps:
        token, raw = texts.of(lp.token_id)
        top = []
        for tid, value in lp.top[:top_k]:
            t, b = texts.of(tid)
            top.append({"token": t, "logprob": value, "bytes": b})
        out.append({"token": token, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return out


class CompletionLogprobs:
    """Accumulates the legacy completions logprobs of one choice."""

    def __init__(self, texts: TokenTexts, top_k: int, offset: int = 0) -> None:
        self.texts = texts
        self.top_k = top_k
        self.offset = offset  # characters of text before the next token
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add_unscored(self, token_id: int) -> None:
        """A token with no logprob (the prompt's first, with echo)."""
        self._token(token_id, None, None)

    def add(self, lps: list[TokenLogprob]) -> None:
        for lp in lps:
            # The chosen token's logprob always, plus the top k (OpenAI: up to k+1 entries).
            top = {self.texts.of(t)[0]: v for t, v in lp.top[: self.top_k]}
            top.setdefault(self.texts.of(lp.token_id)[0], lp.logprob)
            self._token(lp.token_id, lp.logprob, top)

    def _token(self, token_id: int, logprob: float | None, top: dict[str, float] | None) -> None:
        token = self.texts.of(token_id)[0]
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += 0 if token.startswith("bytes:") else len(token)

    def take(self) -> dict[str, Any]:
        """What accumulated since the last take (a stream's chunk), then start afresh."""
        body = {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return body
