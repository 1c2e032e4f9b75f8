"""vLLM's KV events re-keyed into kvroute's: the same blocks, named by kvroute's own hash chain.

vLLM names a block by its own digest (its seed, its algorithm, maybe truncated to 64 bits); the
router predicts hits with ``kvroute.hashing``. So the bridge never forwards vLLM's hashes: for each
``BlockStored`` it recomputes every block's kvroute digest from the token ids and extra keys::

    vLLM  BlockStored(hashes=[v3, v4], parent=v2, token_ids=t[96:160])
                           │ map[v2] = d2 (kvroute digest of the parent, stored earlier)
    kvroute d3 = H(d2, t[96:128], extra_3), d4 = H(d3, t[128:160], extra_4)
          BlockStored(block_hashes=[int(d3), int(d4)], parent_block_hash=int(d2), ...)

and keeps ``vLLM hash -> kvroute digest`` for the blocks it announced, so that a ``BlockRemoved``
names the same blocks. With vLLM's defaults (sha256_cbor, no PYTHONHASHSEED) and kvroute's
(sha256_cbor, seed "vllm-none-hash") the two chains are equal, but nothing here relies on it.

Extra keys. vLLM publishes them untagged, per block: a LoRA name (when ``lora_name`` is set), then
``(mm_identifier, offset)`` pairs, the cache salt (a string, block 0 only), prompt-embedding
digests (bytes). The multimodal pairs and the salt become kvroute's tagged ``("mm", identifier,
offset)`` and ``("cache_salt", salt)``, which vLLM also hashes tagged. LoRA is refused: kvroute keys
an adapter by ``("lora", name, path)`` (as vLLM hashes it) but the event carries only the name,
so no key the router computes could match. Prompt embeddings are refused: kvroute has no such key.

Guarantees: no phantom blocks. A ``BlockRemoved`` of a hash the bridge never announced (it joined
mid-stream, or skipped the store) is counted and dropped; a ``BlockStored`` whose parent the bridge
does not know is counted and dropped whole (its blocks cannot be keyed). Blocks are reference
counted per medium, as vLLM announces every cached copy of a hash and removes each one.
vLLM's ``kv_cache_report_mode="full"`` (a per-request option that re-announces prefix hits) is not
supported: it would count copies that were never made.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from kvroute.events import GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvroute.hashing import BlockHasher, ExtraKeys, to_event_int
from replica.bridge.vllm_events import (
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEvent,
    VllmHash,
)


class RekeyRefusedError(ValueError):
    """vLLM publishes something kvroute cannot key the same way (a block-size mismatch, LoRA, prompt
    embeddings, a second KV cache group): the bridge must refuse the server, loudly. ``field`` names
    the event field."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass
class RekeyStats:
    """Counters of one :class:`Rekeyer` since it was made (``reset`` keeps them)."""

    blocks_stored: int = 0
    blocks_removed: int = 0
    unknown_removals: int = 0  # BlockRemoved hashes never announced: dropped
    unknown_parent_blocks: int = 0  # blocks of a BlockStored whose parent is unknown: dropped
    conflicting_blocks: int = 0  # a vLLM hash already mapped to another kvroute digest: dropped
    clears: int = 0


@dataclass(slots=True)
class _Block:
    digest: bytes  # kvroute's full digest (the chain's parent for the next block)
    copies: Counter  # medium -> cached copies vLLM announced and has not removed


def _medium(medium: str | None) -> str:
    return medium or GPU


class Rekeyer:
    """Translates vLLM's events, in stream order, into kvroute's.

    Owns ``vLLM hash -> (kvroute digest, copies per medium)`` for every block vLLM announced and
    has not removed (invariant: every entry has at least one copy). Not thread-safe; pure (no I/O).

    Args:
        hasher: kvroute's chain, whose ``block_size`` vLLM's must equal (its ``--block-size``).
    """

    def __init__(self, hasher: BlockHasher):
        self.hasher = hasher
        self.stats = RekeyStats()
        self._blocks: dict[VllmHash, _Block] = {}

    def __len__(self) -> int:
        """vLLM hashes known now."""
        return len(self._blocks)

    def held(self) -> dict[str, list[int]]:
        """``medium -> kvroute event ints`` of every block vLLM holds now (a snapshot's content)."""
        out: dict[str, list[int]] = {}
        for block in self._blocks.values():
            for medium in block.copies:
                out.setdefault(medium, []).append(to_event_int(block.digest))
        return out

    def reset(self) -> None:
        """Forget every block (a new epoch: the server restarted, or the stream could not be repaired)."""
        self._blocks.clear()

    def translate(self, events: Iterable[VllmEvent]) -> list[KVCacheEvent]:
        """kvroute's events for one batch of vLLM's, in order (an event may translate to nothing).

        Raises:
            RekeyRefusedError: see the class; nothing of the batch should then be published.
        """
        out: list[KVCacheEvent] = []
        for event in events:
            got = self.translate_event(event)
            if got is not None:
                out.append(got)
        return out

    def translate_event(self, event: VllmEvent) -> KVCacheEvent | None:
        """kvroute's event for one of vLLM's, or None when nothing of it can be announced."""
        if isinstance(event, VllmBlockStored):
            return self._stored(event)
        if isinstance(event, VllmBlockRemoved):
            return self._removed(event)
        if isinstance(event, VllmAllBlocksCleared):
            self._blocks.clear()
            self.stats.clears += 1
            return AllBlocksCleared(medium=None)
        raise TypeError(f"not a vLLM KV event: {event!r}")

    # -- BlockStored ---------------------------------------------------------------------------------
    def _check(self, event: VllmBlockStored) -> None:
        B = self.hasher.block_size
        if event.block_size != B:
            raise RekeyRefusedError("block_size", f"vLLM publishes blocks of {event.block_size} tokens, kvroute "
                                    f"hashes blocks of {B}: start vLLM with --block-size {B}")
        if len(event.token_ids) != len(event.block_hashes) * B:
            raise RekeyRefusedError("token_ids", f"{len(event.token_ids)} tokens for {len(event.block_hashes)} "
                                    f"blocks of {B}")
        if event.group_idx not in (None, 0):
            raise RekeyRefusedError("group_idx", f"KV cache group {event.group_idx}: kvroute indexes one group "
                                    "(a model with one attention type)")
        if event.lora_name is not None or event.lora_id is not None:
            raise RekeyRefusedError("lora_name", f"LoRA {event.lora_name!r} (id {event.lora_id}): the event "
                                    "carries no adapter path, which kvroute's LoRA key needs")

    @staticmethod
    def _extra(raw: tuple | None, field: str) -> ExtraKeys:
        """kvroute's tagged extra keys of one block from vLLM's untagged ones (LoRA already refused)."""
        if raw is None:
            return None
        keys: list[tuple] = []
        for j, key in enumerate(raw):
            if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and type(key[1]) is int:
                keys.append(("mm", key[0], key[1]))
            elif isinstance(key, str):
                keys.append(("cache_salt", key))
            elif isinstance(key, bytes):
                raise RekeyRefusedError(f"{field}[{j}]", "prompt embeddings: kvroute has no key for them")
            else:
                raise RekeyRefusedError(f"{field}[{j}]", f"an extra key kvroute does not know: {key!r}")
        return tuple(keys) or None

    def _stored(self, event: VllmBlockStored) -> BlockStored | None:
        self._check(event)
        n = len(event.block_hashes)
        if n == 0:
            return None
        if event.parent_block_hash is None:
            parent = None
        else:
            known = self._blocks.get(event.parent_block_hash)
            if known is None:
                self.stats.unknown_parent_blocks += n
                return None
            parent = known.digest
        B = self.hasher.block_size
        raw_extra = event.extra_keys or (None,) * n
        extras = [self._extra(raw, f"extra_keys[{i}]") for i, raw in enumerate(raw_extra)]
        if any(extras):
            digests, d = [], parent
            for i, extra in enumerate(extras):
                d = self.hasher.hash_block(d, event.token_ids[i * B:(i + 1) * B], extra)
                digests.append(d)
        else:
            digests = self.hasher.hash_blocks(event.token_ids, parent=parent or self.hasher.none_hash)
        medium = _medium(event.medium)
        kept = 0
        for vllm_hash, digest in zip(event.block_hashes, digests, strict=True):
            block = self._blocks.get(vllm_hash)
            if block is None:
                self._blocks[vllm_hash] = _Block(digest, Counter({medium: 1}))
            elif block.digest == digest:
                block.copies[medium] += 1
            else:  # the rest of the run chains on a block the router would key otherwise: drop it
                self.stats.conflicting_blocks += n - kept
                break
            kept += 1
        if kept == 0:
            return None
        self.stats.blocks_stored += kept
        return BlockStored(
            block_hashes=tuple(to_event_int(d) for d in digests[:kept]),
            parent_block_hash=None if parent is None else to_event_int(parent),
            token_ids=event.token_ids[: kept * B],
            block_size=B,
            medium=medium,
            extra_keys=tuple(extras[:kept]) if any(extras[:kept]) else None,
        )

    # -- BlockRemoved --------------------------------------------------------------------------------
    def _removed(self, event: VllmBlockRemoved) -> BlockRemoved | None:
        medium = _medium(event.medium)
        if event.group_idx not in (None, 0):
            raise RekeyRefusedError("group_idx", f"KV cache group {event.group_idx}: kvroute indexes one group")
        out = []
        for vllm_hash in event.block_hashes:
            block = self._blocks.get(vllm_hash)
            if block is None or block.copies[medium] <= 0:
                self.stats.unknown_removals += 1
                continue
            block.copies[medium] -= 1
            if block.copies[medium] == 0:
                del block.copies[medium]
                if not block.copies:
                    del self._blocks[vllm_hash]
            out.append(to_event_int(block.digest))
        self.stats.blocks_removed += len(out)
        return BlockRemoved(block_hashes=tuple(out), medium=medium) if out else None


__all__ = ["RekeyRefusedError", "RekeyStats", "Rekeyer"]
