"""KV data plane: moves KV bytes between processes, never through NATS messages."""

from shared.transfer.base import KVReceiver, KVSender, TransferFailed, TransferState

__all__ = ["KVReceiver", "KVSender", "TransferFailed", "TransferState"]
