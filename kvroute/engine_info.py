"""What a replica's engine is: the one identity / model-info shape (DESIGN.md §2, §3.3).

Fixed once the engine is built. The engine process reports it to the server process, the server
answers ``GetModelInfo`` with it and validates requests against it, and its heartbeat part
(model, block_size, hash triple, num_blocks, vocab_size, max_model_len, attention backend) goes
into every :class:`kvroute.heartbeat.Heartbeat`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.v1 import generation_pb2 as gen_pb


@dataclass(frozen=True)
class EngineInfo:
    """A built engine's identity and limits.

    Attributes:
        model: the served model name.
        vocab_size: token ids are valid in ``[0, vocab_size)``.
        max_model_len: prompt + output tokens one request may hold.
        block_size: tokens per KV block (and per hashed block).
        num_blocks: KV blocks on the device, the null block included.
        hash_algorithm, hash_seed_digest: the block-hash chain's algorithm (``sha256_cbor`` or
            ``xxhash_cbor``) and the hex digest identifying its seed (``BlockHasher.identity``).
        eos_token_id: the tokenizer's end-of-sequence id, if any.
        extra_eos_token_ids: further ids that end a generation (e.g. a chat model's end-of-turn),
            added to every request's stop ids unless it sets ``ignore_eos``.
        attn_backend, attn_backend_reason: the paged-attention backend the engine runs
            (``torch``, ``flash_attn`` or ``triton``) and why it was chosen (DESIGN.md §3.2);
            informational, the router routes the same whatever they say.
    """

    model: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    hash_algorithm: str
    hash_seed_digest: str
    eos_token_id: int | None = None
    extra_eos_token_ids: tuple[int, ...] = ()
    attn_backend: str = ""
    attn_backend_reason: str = ""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation: ``eos_token_id`` first, then the extra ones."""
        return ((self.eos_token_id,) if self.eos_token_id is not None else ()) + self.extra_eos_token_ids

    def to_proto(self) -> gen_pb.ModelInfo:
        """The ``GetModelInfo`` answer."""
        return gen_pb.ModelInfo(
            model=self.model, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            block_size=self.block_size, hash_algorithm=self.hash_algorithm,
            hash_seed_digest=self.hash_seed_digest, eos_token_ids=list(self.eos_token_ids),
        )


__all__ = ["EngineInfo"]
