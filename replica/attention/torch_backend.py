"""Paged attention in plain PyTorch: gather K/V through the block table, then
``scaled_dot_product_attention``. Runs on CPU and CUDA; the reference the fast backends are
checked against.

Decodes (query_len 1) are batched. Once per step a ``DecodePlan`` sorts them by length into a few
buckets; then every layer runs one gather and one masked SDPA call per bucket::

    decodes sorted by blocks:  [ r3 r0 r5 | r1 r4 | r2 ]   a bucket closes where padding its rows to
                                 bucket 0   b 1    b 2     the next length costs more than one call
    per bucket, per layer:     kv_cache.view(2 * num_blocks, B, Hkv, D).index_select(K ids, V ids)
                               -> K, V [n, Hkv, S, D] (strided views of the copy) -> SDPA with q as
                               [n, Hkv, group, D] and an additive mask (-inf at positions >= seq_len)

Prefill chunks (query_len > 1) run one SDPA call each on exactly their ``seq_len`` keys.

On the CPU in float32, when the optional C extension ``replica.attention._cpu_paged`` was built
(``setup.py``), decodes skip the gather: one call attends every decode of the step, reading K/V
blocks in place through the block table (``_cpu_paged.c``); with torch on N > 1 threads the
decodes are split over N workers (the kernel releases the GIL). Same results within float rounding
(tests compare both paths); ``TorchAttentionBackend(cpu_kernel=False)`` forces the gather path.
Reading blocks in place saves the gather's copy, which is most of a decode's cost on the CPU.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from replica.attention.backend import AttentionBackend
from replica.attention.metadata import AttentionMetadata

try:
    from replica.attention import _cpu_paged
except ImportError:  # built without a C compiler: decodes take the gather + SDPA path
    _cpu_paged = None

_TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
_SDPA_HAS_GQA = _TORCH_VERSION >= (2, 5)

# Bucketing cost model: one more bucket costs about what gathering and attending this many bytes
# of padding does (a call's fixed cost times the gather's bandwidth). For the default model (4 KV
# heads of 32, fp32) a 16-token block pair is 16 KiB, so up to 64 blocks of padding stay in one
# bucket. The step time is flat around the optimum, so a coarse value is fine.
_BUCKET_OVERHEAD_BYTES = 2**20
# A bucket's gather is capped at this many bytes (a single longer request still gets its own
# bucket): it bounds the reusable gather buffer, which a step with many long decodes would
# otherwise grow to their whole padded K/V.
_MAX_BUCKET_BYTES = 16 * 2**20


@dataclass(frozen=True)
class DecodeBucket:
    """Decodes attended in one SDPA call.

    ``rows``: their query rows in the flattened batch (a slice when consecutive). Each is padded
    to ``num_blocks`` blocks; ``gather_index`` [2 * n * num_blocks] selects the K blocks, then the
    V blocks, from ``kv_cache.view(2 * num_cache_blocks, B, Hkv, D)``. The first ``max_seq_len``
    gathered positions are attended; ``mask`` [n, 1, 1, max_seq_len] (additive, -inf past each
    row's seq_len) or None when every row has ``max_seq_len`` keys.
    """

    rows: torch.Tensor | slice
    num_reqs: int
    num_blocks: int
    max_seq_len: int
    gather_index: torch.Tensor
    mask: torch.Tensor | None


@dataclass(frozen=True)
class DecodePlan:
    """One step's decode buckets, the other (prefill-chunk) requests, and whether the decodes are
    every row of the batch in order (then the output needs no zero fill)."""

    buckets: tuple[DecodeBucket, ...]
    prefill_reqs: tuple[int, ...]
    decodes_cover_all_rows: bool


def build_decode_plan(metadata: AttentionMetadata, kv_cache: torch.Tensor, dtype: torch.dtype) -> DecodePlan:
    """Bucket the step's decodes (module docstring). Host-side numpy; ``TorchAttentionBackend``
    caches the plan on the metadata, so it runs once per step."""
    _, num_cache_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    qsl = metadata.query_start_loc_cpu.numpy()
    seq_lens = metadata.seq_lens_cpu.numpy().astype(np.int64)
    is_decode = np.diff(qsl) == 1
    decodes = np.flatnonzero(is_decode)
    prefills = tuple(np.flatnonzero(~is_decode).tolist())
    if decodes.size == 0:
        return DecodePlan((), prefills, False)
    table = metadata.block_table_cpu.numpy()
    nb = -(-seq_lens[decodes] // block_size)
    pair_bytes = 2 * block_size * num_kv_heads * head_dim * kv_cache.element_size()
    max_blocks = max(1, _MAX_BUCKET_BYTES // pair_bytes)
    overhead = max(1, _BUCKET_OVERHEAD_BYTES // pair_bytes)
    if _one_bucket_is_best(nb, max_blocks, overhead):
        groups = [decodes]
    else:
        order = np.argsort(nb, kind="stable")
        # Each bucket keeps its rows in batch order, so consecutive rows become a slice.
        bounds = _bucket_bounds(nb[order], max_blocks, overhead)
        groups = [decodes[np.sort(order[lo:hi])] for lo, hi in bounds]
    device = kv_cache.device
    buckets = tuple(
        _bucket(idx, qsl, seq_lens, table, num_cache_blocks, block_size, dtype, device) for idx in groups
    )
    covers = not prefills and len(buckets) == 1 and metadata.num_actual_tokens == metadata.num_tokens
    return DecodePlan(buckets, prefills, covers)


def _one_bucket_is_best(nb: np.ndarray, max_blocks: int, overhead: int) -> bool:
    padded = int(nb.max()) * nb.shape[0]
    return padded - int(nb.sum()) <= overhead and padded <= max_blocks


def _bucket_bounds(sorted_nb: np.ndarray, max_blocks: int, overhead: int) -> list[tuple[int, int]]:
    """Split block counts sorted ascending into [lo, hi) runs, greedily: a run closes before a
    row when padding the whole run to that row's length would waste more than ``overhead``
    blocks (the price of a new bucket), or when the run's gather would pass ``max_blocks``."""
    counts = sorted_nb.tolist()
    bounds = []
    lo, run_sum = 0, counts[0]
    for i in range(1, len(counts)):
        size = i - lo
        padded = (size + 1) * counts[i]
        if padded - run_sum - counts[i] > overhead or padded > max_blocks:
            bounds.append((lo, i))
            lo, run_sum = i, 0
        run_sum += counts[i]
    bounds.append((lo, len(counts)))
    return bounds


def _bucket(
    idx: np.ndarray,
    qsl: np.ndarray,
    seq_lens: np.ndarray,
    table: np.ndarray,
    num_cache_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> DecodeBucket:
    n = idx.shape[0]
    s = seq_lens[idx]
    nb = -(-s // block_size)
    max_nb = int(nb.max())
    max_seq = int(s.max())
    blocks = table[idx, :max_nb].astype(np.int64)
    # Cells past a row's own blocks may hold anything (the builder pads with 0): point them at
    # the zero-filled null block 0, whose keys the mask hides.
    blocks[np.arange(max_nb) >= nb[:, None]] = 0
    flat = blocks.reshape(-1)
    gather_index = torch.from_numpy(np.concatenate((flat, flat + num_cache_blocks))).to(device)
    rows_np = qsl[idx].astype(np.int64)  # ascending
    first_row = int(rows_np[0])
    if int(rows_np[-1]) - first_row == n - 1:
        rows: torch.Tensor | slice = slice(first_row, first_row + n)
    else:
        rows = torch.from_numpy(rows_np).to(device)
    mask = None
    if int(s.min()) < max_seq:
        additive = np.where(np.arange(max_seq) >= s[:, None], np.float32(-np.inf), np.float32(0))
        mask = torch.from_numpy(additive).view(n, 1, 1, max_seq).to(device=device, dtype=dtype)
    return DecodeBucket(rows, n, max_nb, max_seq, gather_index, mask)


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with ``torch.nn.functional.scaled_dot_product_attention``.

    Query token j of a request sits at position ``seq_len - query_len + j`` and sees keys ``0 ..``
    that position (a bottom-right-aligned causal mask). Decodes see every key of their request:
    they are batched per step into length buckets (module docstring), and their GQA groups become
    the query axis (``[n, Hkv, group, D]``) so K/V are never repeated. Prefill chunks run one call
    each, with SDPA's ``enable_gqa`` (torch >= 2.5) or ``repeat_interleave``.

    Why this shape: batching decodes per length bucket beats one SDPA call per decode; one padded
    bucket for all loses to the extra bytes copied (and a gather that large is a fresh mmap, page
    faults included, on every call); reading the blocks in place (the C kernel) beats any gather,
    which is why ``_cpu_paged.c`` takes CPU float32 decodes whenever it was built. The gather path
    stays for other dtypes and devices, and for installs without a C compiler.
    """

    name = "torch"

    def __init__(self, cpu_kernel: bool | None = None) -> None:
        """``cpu_kernel``: attend CPU float32 decodes with the compiled paged kernel (module doc);
        None = when it was built, False = never (the gather path).

        Raises:
            ImportError: ``cpu_kernel=True`` and the extension was not built.
        """
        if cpu_kernel and _cpu_paged is None:
            raise ImportError("replica.attention._cpu_paged was not built (no C compiler at install time)")
        self.cpu_kernel = _cpu_paged is not None if cpu_kernel is None else cpu_kernel
        self._scratch: torch.Tensor | None = None
        self._pool: ThreadPoolExecutor | None = None  # kernel workers when torch has > 1 thread
        self._pool_size = 0

    def _attend(
        self, query: torch.Tensor, step_kv: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
        metadata: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """Decodes batched (the CPU kernel, or length buckets), then one SDPA call per prefill chunk."""
        key, value = step_kv
        if (
            self.cpu_kernel
            and kv_cache.device.type == "cpu"
            and kv_cache.dtype == torch.float32
            and query.dtype == torch.float32
        ):
            out, prefill_reqs = self._decode_cpu_kernel(query, kv_cache, metadata, scale)
        else:
            plan_key = ("torch_decode_plan", kv_cache.shape, kv_cache.dtype, query.dtype)
            plan = metadata.derived.get(plan_key)
            if plan is None:
                plan = metadata.derived[plan_key] = build_decode_plan(metadata, kv_cache, query.dtype)
            head_dim = kv_cache.shape[4]
            if plan.decodes_cover_all_rows:
                bucket = plan.buckets[0]
                return self._decode(query, kv_cache, bucket, scale).view(query.shape)
            out = torch.zeros_like(query)
            for bucket in plan.buckets:
                o = self._decode(query[bucket.rows], kv_cache, bucket, scale)
                out[bucket.rows] = o.view(bucket.num_reqs, -1, head_dim)
            prefill_reqs = plan.prefill_reqs
        if not prefill_reqs:
            return out
        starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        block_size = kv_cache.shape[2]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        for i in prefill_reqs:
            seq_len = seq_lens[i]
            start, end = starts[i], starts[i + 1]
            query_len = end - start
            if query_len == seq_len and key.dtype == kv_cache.dtype:
                # A whole prompt: its keys are this step's, exactly as just written; no gather.
                k, v = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)
            else:
                blocks = metadata.block_table[i, : -(-seq_len // block_size)]
                # index_select on whole blocks copies at memcpy speed; advanced indexing is slower.
                k = key_cache.index_select(0, blocks).flatten(0, 1)[:seq_len].transpose(0, 1)
                v = value_cache.index_select(0, blocks).flatten(0, 1)[:seq_len].transpose(0, 1)
                k, v = k.to(query.dtype), v.to(query.dtype)
            k, v = k.unsqueeze(0), v.unsqueeze(0)  # [1, Hkv, seq_len, D]
            q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, query_len, D]
            if query_len == seq_len:
                o = _sdpa(q, k, v, None, True, scale)
            else:
                q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
                k_pos = torch.arange(seq_len, device=query.device)
                o = _sdpa(q, k, v, k_pos[None, :] <= q_pos[:, None], False, scale)
            out[start:end] = o[0].transpose(0, 1)
        return out

    def _decode_cpu_kernel(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Every decode of the step in one ``_cpu_paged.paged_decode`` call: (out with the decode
        rows filled, the prefill requests left to attend)."""
        plan = metadata.derived.get("cpu_kernel_plan")
        if plan is None:
            qsl = metadata.query_start_loc_cpu.numpy()
            is_decode = np.diff(qsl) == 1
            reqs = np.flatnonzero(is_decode)
            prefills = tuple(np.flatnonzero(~is_decode).tolist())
            covers = not prefills and metadata.num_actual_tokens == metadata.num_tokens
            rows = qsl[reqs].astype(np.int64)
            # Once per step, shared by every layer: the host tables as the kernel reads them.
            tables = (np.ascontiguousarray(metadata.block_table_cpu.numpy()), metadata.seq_lens_cpu.numpy())
            plan = metadata.derived["cpu_kernel_plan"] = (rows, reqs.astype(np.int64), prefills, covers, tables)
        rows, reqs, prefills, covers, (table, seq_lens) = plan
        query = query.contiguous()
        out = torch.empty_like(query) if covers else torch.zeros_like(query)
        if not rows.size:
            return out, prefills
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        args = (out.numpy(), query.numpy(), kv_cache.numpy(), table, seq_lens)
        shape = (query.shape[1], num_kv_heads, head_dim, block_size, scale)
        threads = min(torch.get_num_threads(), rows.size // 4)
        if threads <= 1:
            _cpu_paged.paged_decode(*args, rows, reqs, *shape)
            return out, prefills
        # The kernel releases the GIL: as many workers as torch has intra-op threads (idle while
        # it runs), each on its own slice of the decodes (disjoint output rows).
        if self._pool_size < threads:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="paged-decode")
            self._pool_size = threads
        parts = zip(np.array_split(rows, threads), np.array_split(reqs, threads), strict=True)
        for f in [self._pool.submit(_cpu_paged.paged_decode, *args, r, q, *shape) for r, q in parts]:
            f.result()
        return out, prefills

    def _decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, bucket: DecodeBucket, scale: float
    ) -> torch.Tensor:
        """query [n, H, D] of one bucket's decodes -> [n, Hkv, group, D]."""
        _, num_cache_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        n = bucket.num_reqs
        flat = kv_cache.view(2 * num_cache_blocks, block_size, num_kv_heads, head_dim)
        scratch = self._scratch_for(flat, bucket.gather_index.numel())
        kv = torch.index_select(flat, 0, bucket.gather_index, out=scratch)
        kv = kv.view(2, n, bucket.num_blocks * block_size, num_kv_heads, head_dim)[:, :, : bucket.max_seq_len]
        if kv.dtype != query.dtype:
            kv = kv.to(query.dtype)
        k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [n, Hkv, S, D], strided
        q = query.reshape(n, num_kv_heads, -1, head_dim)  # [n, Hkv, group, D]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bucket.mask, scale=scale)

    def _scratch_for(self, flat_cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """A [num_blocks, B, Hkv, D] view of the reusable gather buffer (grown on demand; every
        layer and bucket shares it, SDPA has consumed it before the next gather). A fresh tensor
        per gather page-faults on every call once the gathers are large."""
        shape = (num_blocks, *flat_cache.shape[1:])
        numel = num_blocks * flat_cache[0].numel()
        buf = self._scratch
        stale = buf is None or (buf.dtype, buf.device) != (flat_cache.dtype, flat_cache.device)
        if stale or buf.numel() < numel:
            buf = self._scratch = torch.empty(numel, dtype=flat_cache.dtype, device=flat_cache.device)
        return buf[:numel].view(shape)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    """q [N, H, L, D], k/v [N, Hkv, S, D]; boolean mask [L, S], True = attend."""
    if q.shape[1] == k.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    if _SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
