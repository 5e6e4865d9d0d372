"""A reserved sequence's KV arriving in layer slices (pure bookkeeping, no torch).

A prompt prefilled by a pipeline (stage.py) has each block's KV split by layer range among
the stages, and each stage sends its slices on its own, streamed chunk by chunk. A block
is in place on decode only once every layer of it has arrived, so the decode side counts,
per block, which layers it holds; the leading blocks that are whole are what the
sequence has computed.
"""

from __future__ import annotations


class SliceProgress:
    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._layers: list[bytearray] = []  # per block: 1 where that layer has arrived
        self._whole = 0  # leading blocks with every layer
        self.tokens = 0  # the most tokens any slice said it covers

    def add(
        self, first_block: int, num_blocks: int, first_layer: int, num_layers: int, tokens: int
    ) -> int:
        """Blocks first_block .. +num_blocks hold layers first_layer .. +num_layers now;
        returns the leading blocks that are whole."""
        if not 0 <= first_layer < first_layer + num_layers <= self.num_layers:
            raise ValueError(f"layers {first_layer}..{first_layer + num_layers} out of range")
        end = first_block + num_blocks
        while len(self._layers) < end:
            self._layers.append(bytearray(self.num_layers))
        for b in range(first_block, end):
            self._layers[b][first_layer : first_layer + num_layers] = b"\x01" * num_layers
        while self._whole < len(self._layers) and all(self._layers[self._whole]):
            self._whole += 1
        self.tokens = max(self.tokens, tokens)
        return self._whole

    @property
    def whole_blocks(self) -> int:
        return self._whole

    def covered_tokens(self, block_size: int) -> int:
        """Tokens whose KV is in place in every layer."""
        return min(self._whole * block_size, self.tokens)

    def mark_whole(self, num_blocks: int) -> None:
        """The first `num_blocks` are in place already (this pool cached them)."""
        for b in range(min(num_blocks, len(self._layers))):
            self._layers[b][:] = b"\x01" * self.num_layers
        while len(self._layers) < num_blocks:
            self._layers.append(bytearray(b"\x01" * self.num_layers))
        self._whole = max(self._whole, num_blocks)
