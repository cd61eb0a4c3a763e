"""Paged KV cache: a fixed pool of blocks per layer, per-sequence block tables.

Layout follows ATB/vLLM (ND): per layer ``key_cache`` and ``value_cache`` of
shape ``[num_blocks, block_size, num_kv_heads, head_dim]``. A sequence owns a
list of block ids (its block table); token position ``p`` of that sequence
lives at slot ``table[p // block_size] * block_size + p % block_size``.

The pool is sized once, up front, so memory is known before the first token;
the tensors are allocated empty (``torch.empty``, or 2 MiB huge pages through
``atb.hugepages.empty``; either way pages are committed by the OS
only when first written, so a large pool costs address space, not RSS, until
it is used). Allocation is all-or-nothing: a request that cannot be met raises
before any block changes hands, so the free-block count always balances.
"""
from __future__ import annotations

import torch

from atb import hugepages


class CacheFullError(RuntimeError):
    """Not enough free blocks for a request; nothing was allocated."""


class PagedKVCache:
    """Block pool for ``num_layers`` layers plus the block tables of live sequences.

    Sequences are named by any hashable id. Blocks are handed out lowest id
    first and returned on :meth:`free`; :attr:`free_blocks` counts what is left.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, num_blocks: int, block_size: int = 128,
                 dtype: torch.dtype = torch.float32):
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"PagedKVCache: {name} must be a positive int, got {v!r}")
        if block_size & (block_size - 1):
            raise ValueError(f"PagedKVCache: block_size must be a power of two, got {block_size}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # One allocation per K and V; each layer's cache is a contiguous view,
        # so a native graph can address layer l as base + l * layer_stride.
        # In huge pages where they are on (atb.hugepages): each decode step streams every live sequence's blocks.
        self.key_pool = hugepages.empty(shape, dtype)
        self.value_pool = hugepages.empty(shape, dtype)
        self.key_caches = list(self.key_pool.unbind(0))
        self.value_caches = list(self.value_pool.unbind(0))
        # A stack popped from the end: reversed so block 0 goes out first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._tables: dict = {}

    @classmethod
    def for_capacity(cls, num_layers: int, num_kv_heads: int, head_dim: int, *, max_batch_size: int,
                     max_seq_len: int, block_size: int = 128, dtype: torch.dtype = torch.float32,
                     **kwargs) -> "PagedKVCache":
        """A pool that holds ``max_batch_size`` sequences of ``max_seq_len`` tokens at once (``kwargs``: a
        subclass's own options)."""
        per_seq = -(-max_seq_len // block_size)
        return cls(num_layers, num_kv_heads, head_dim, num_blocks=max_batch_size * per_seq, block_size=block_size,
                   dtype=dtype, **kwargs)

    # ---- accounting ---------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.key_pool.nbytes + self.value_pool.nbytes

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def sequences(self) -> list:
        return list(self._tables)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._tables

    # ---- allocation ---------------------------------------------------------
    def allocate(self, seq_id, num_tokens: int) -> list[int]:
        """Creates the block table of a new sequence with room for ``num_tokens`` tokens.

        Returns the live table: the same list grows in place on :meth:`extend`.
        """
        if seq_id in self._tables:
            raise ValueError(f"PagedKVCache.allocate: sequence {seq_id!r} already has blocks")
        if num_tokens < 0:
            raise ValueError(f"PagedKVCache.allocate: num_tokens must be >= 0, got {num_tokens}")
        table = self._take(self.blocks_needed(num_tokens), seq_id)
        self._tables[seq_id] = table
        return table

    def extend(self, seq_id, num_tokens: int) -> list[int]:
        """Grows a sequence's table to hold ``num_tokens`` tokens in total (never shrinks it)."""
        table = self._table(seq_id, "extend")
        need = self.blocks_needed(num_tokens) - len(table)
        if need > 0:
            table.extend(self._take(need, seq_id))
        return table

    def free(self, seq_id) -> None:
        """Returns a sequence's blocks to the pool (unknown ids are an error)."""
        table = self._table(seq_id, "free")
        del self._tables[seq_id]
        self._free.extend(reversed(table))

    def free_all(self) -> None:
        for seq_id in list(self._tables):
            self.free(seq_id)

    def _take(self, n: int, seq_id) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(f"PagedKVCache: sequence {seq_id!r} needs {n} more blocks, only {len(self._free)} "
                                 f"of {self.num_blocks} are free")
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        return taken

    def _table(self, seq_id, op: str) -> list[int]:
        table = self._tables.get(seq_id)
        if table is None:
            raise KeyError(f"PagedKVCache.{op}: unknown sequence {seq_id!r}")
        return table

    # ---- metadata -----------------------------------------------------------
    def block_table(self, seq_id) -> list[int]:
        return list(self._table(seq_id, "block_table"))

    def slots(self, seq_id, start: int, end: int) -> list[int]:
        """Cache slots of positions ``[start, end)`` of a sequence (they must be allocated)."""
        table = self._table(seq_id, "slots")
        bs = self.block_size
        if start < 0 or end > len(table) * bs or start > end:
            raise ValueError(f"PagedKVCache.slots: positions [{start}, {end}) outside the {len(table) * bs} "
                             f"allocated slots of sequence {seq_id!r}")
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def slot_mapping(self, seq_ids, starts, ends) -> torch.Tensor:
        """int32 slots of positions ``[starts[i], ends[i])`` of each sequence, concatenated."""
        out: list[int] = []
        for s, a, b in zip(seq_ids, starts, ends):
            out += self.slots(s, a, b)
        return torch.tensor(out, dtype=torch.int32)

    def block_tables(self, seq_ids, width: int | None = None) -> torch.Tensor:
        """int32 ``[len(seq_ids), width]`` block tables, padded with 0 (never read past context_lens)."""
        tables = [self._table(s, "block_tables") for s in seq_ids]
        width = max((len(t) for t in tables), default=0) if width is None else width
        out = torch.zeros(len(tables), max(width, 1), dtype=torch.int32)
        for i, t in enumerate(tables):
            if len(t) > width:
                raise ValueError(f"PagedKVCache.block_tables: sequence {seq_ids[i]!r} has {len(t)} blocks, "
                                 f"width is {width}")
            if t:
                out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        return out

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={self.num_layers}, blocks={self.num_blocks}x{self.block_size}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
                f"free={self.free_blocks}, {self.nbytes / 2**20:.1f} MiB)")
