"""The engine's block manager: the paged KV pool plus automatic prefix caching (vLLM APC).

Every FULL block of a prompt is keyed by a hash of (its parent block's hash,
its tokens), so a key names a block's content *and* everything before it: a
block matches only at the same position after the same prefix. On admission a
request takes the longest run of cached blocks that starts its prompt
(reference counted, read only) and gets private blocks for the rest; prefill
then computes only the uncached suffix. The last partial block of a prompt, and
every block past the prompt, is private while it is being written, so decode
never writes a shared block either.

A block that decode fills is keyed the same way once its K/V is written
(:meth:`key_block`, from the scheduler): a follow-up chat turn that resends the
previous answer finds that answer's full blocks cached too.

A block is in exactly one of three states, and the counts always add up to
``num_blocks``:

* **used**: held by at least one request (reference count >= 1);
* **cached**: no request holds it but its content is still keyed; it is reused
  by a later prompt with the same prefix, or evicted (least recently freed
  first) when the free list runs dry;
* **free**: unkeyed, on the free list.

Blocks are keyed at admission, before the prefill that fills them runs, so two
requests admitted in the same step share the prefix that the first of them
computes (each layer writes all of its K/V before any attention reads it). Until
that prefill finishes the keys are *pending*: :meth:`commit` confirms them,
:meth:`discard_pending` (the prefill raised) forgets them so that a block whose
K/V was never written is never matched.

With ``enable_prefix_caching=False`` nothing is ever keyed and this is the plain
`PagedKVCache`.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

from atb.layers.kv_cache import CacheFullError, PagedKVCache

# The hash chain starts from this parent.
_ROOT = b"atb-prefix-cache-v1"


class BlockManager(PagedKVCache):
    """`PagedKVCache` with reference-counted, content-keyed blocks (see the module docstring)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, num_blocks: int, block_size: int = 128,
                 dtype: torch.dtype = torch.float32, enable_prefix_caching: bool = False):
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"BlockManager: enable_prefix_caching must be a bool, got "
                            f"{type(enable_prefix_caching).__name__}")
        super().__init__(num_layers, num_kv_heads, head_dim, num_blocks=num_blocks, block_size=block_size, dtype=dtype)
        self.enable_prefix_caching = enable_prefix_caching
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}        # block -> key, for keyed blocks (used or cached)
        self._block_of: dict[bytes, int] = {}      # key -> block
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached (zero-ref keyed) blocks, least recent first
        self._pending: list[tuple[int, bytes]] = []  # (block, key) keyed this step, K/V not written yet
        self.query_tokens = 0                      # prompt tokens looked up on admission
        self.hit_tokens = 0                        # of which found in the cache

    # ---- accounting ---------------------------------------------------------
    @property
    def cached_blocks(self) -> int:
        """Blocks no request holds whose content is kept for reuse (evicted when the pool needs them)."""
        return len(self._lru)

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation may take: free ones, then cached ones by eviction."""
        return len(self._free) + len(self._lru)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._lru)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def block_key(self, block: int) -> bytes | None:
        """The key of a block whose content is keyed (held by requests or not), else None."""
        return self._key_of.get(block)

    # ---- prefix lookup ------------------------------------------------------
    def block_keys(self, tokens: list[int]) -> list[bytes]:
        """The chained key of every full block of ``tokens``.

        SHA-256, not Python's ``hash``: a collision would silently hand one request another prefix's K/V, and
        tuple hashes are easy to collide on purpose. It costs a few microseconds per block.
        """
        bs, parent, keys = self.block_size, _ROOT, []
        for i in range(len(tokens) // bs):
            parent = self.chain_key(parent, tokens[i * bs:(i + 1) * bs])
            keys.append(parent)
        return keys

    @staticmethod
    def chain_key(parent: bytes | None, block_tokens: list[int]) -> bytes:
        """The key of a full block of ``block_tokens`` after the block keyed ``parent`` (None: the first block)."""
        return hashlib.sha256((parent or _ROOT) + array("q", block_tokens).tobytes()).digest()

    def cached_prefix(self, keys: list[bytes]) -> list[int]:
        """Blocks of the longest run of ``keys`` (from the first) whose content is cached; nothing changes."""
        if not self.enable_prefix_caching:
            return []
        out = []
        for k in keys:
            b = self._block_of.get(k)
            if b is None:
                break
            out.append(b)
        return out

    # ---- allocation ---------------------------------------------------------
    def allocate_prompt(self, seq_id, prompt: list[int], keys: list[bytes], num_tokens: int,
                        key_upto: int | None = None, share: bool = True) -> tuple[list[int], int]:
        """Creates the table of a new sequence whose first tokens are ``prompt`` (``keys``: its
        :meth:`block_keys`) with room for ``num_tokens`` tokens; returns ``(table, cached_tokens)``.

        The cached prefix is shared (references taken); the prompt's other full blocks up to ``key_upto``
        (all of them by default) are keyed, pending until :meth:`commit` (a chunked prefill keys the rest with
        :meth:`key_prompt_blocks` as its chunks reach them). ``cached_tokens`` may equal ``len(prompt)`` (a
        prompt of whole blocks, all cached): the caller must then recompute the last token without writing its
        K/V. With ``share`` False the cache is not looked up (every block is new, ``cached_tokens`` is 0), but
        the prompt's blocks are keyed all the same. All or nothing: CacheFullError leaves every block as it was.
        """
        if seq_id in self._tables:
            raise ValueError(f"BlockManager.allocate_prompt: sequence {seq_id!r} already has blocks")
        if num_tokens < len(prompt):
            raise ValueError(f"BlockManager.allocate_prompt: num_tokens={num_tokens} is less than the prompt's "
                             f"{len(prompt)} tokens")
        hit = self.cached_prefix(keys) if share else []
        need = self.blocks_needed(num_tokens) - len(hit)
        # Cached blocks that this request revives are no longer available to take.
        revived = sum(1 for b in hit if self._refs[b] == 0)
        if need > self.available_blocks - revived:
            raise CacheFullError(f"BlockManager: sequence {seq_id!r} needs {need} more blocks ({len(hit)} cached), "
                                 f"only {len(self._free)} free and {len(self._lru) - revived} evictable of "
                                 f"{self.num_blocks}")
        for b in hit:
            self._ref(b)
        table = hit + self._take(need, seq_id)
        self._tables[seq_id] = table
        if self.enable_prefix_caching:
            self.key_prompt_blocks(seq_id, keys, len(hit), len(keys) if key_upto is None else key_upto)
            self.query_tokens += len(prompt) if share else 0
            self.hit_tokens += len(hit) * self.block_size
        return table, len(hit) * self.block_size

    def key_prompt_blocks(self, seq_id, keys: list[bytes], lo: int, hi: int) -> None:
        """Keys prompt blocks ``[lo, hi)`` of a sequence (``keys``: the prompt's :meth:`block_keys`) for the
        prefill about to write them, pending until :meth:`commit`."""
        if not self.enable_prefix_caching:
            return
        table = self._table(seq_id, "key_prompt_blocks")
        for i in range(lo, hi):
            # A key already present belongs to a block cut off from its parent's chain (the parent was
            # evicted first): this block stays private and unkeyed rather than replace it.
            if keys[i] not in self._block_of:
                self._key(table[i], keys[i])
                self._pending.append((table[i], keys[i]))

    def key_block(self, seq_id, index: int, key: bytes) -> bool:
        """Keys block ``index`` of a sequence whose K/V is now entirely written (decode filled it): from now on
        it is shared like a prefill block, and cached when freed. A block already keyed, or a key that another
        block holds (the same content computed twice), leaves it as it is; True when it was keyed."""
        if not self.enable_prefix_caching:
            return False
        b = self._table(seq_id, "key_block")[index]
        if b in self._key_of or key in self._block_of:
            return False
        self._key(b, key)
        return True

    def commit(self) -> None:
        """The prefill that fills the pending blocks finished: their keys stand."""
        self._pending.clear()

    def discard_pending(self) -> None:
        """The prefill that was to fill the pending blocks did not finish: unkey them (their holders keep them
        as private blocks; freed, they go to the free list)."""
        for b, key in self._pending:
            if self._key_of.get(b) == key:
                del self._key_of[b]
                del self._block_of[key]
                if self._refs[b] == 0:   # already freed by its holder: cached -> free
                    del self._lru[b]
                    self._free.append(b)
        self._pending.clear()

    def free(self, seq_id) -> None:
        """Drops a sequence's references; a block nobody holds is cached if keyed, else free."""
        table = self._table(seq_id, "free")
        del self._tables[seq_id]
        # Tail first: the deepest blocks of a prefix become the least recent, so eviction takes them before the
        # blocks every continuation of the prefix needs.
        for b in reversed(table):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._key_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    def clear_cached(self) -> int:
        """Forgets every cached (unheld) block, returning them to the free list; how many were dropped."""
        n = len(self._lru)
        for b in reversed(self._lru):
            del self._block_of[self._key_of.pop(b)]
            self._free.append(b)
        self._lru.clear()
        return n

    def _ref(self, b: int) -> None:
        if self._refs[b] == 0:
            del self._lru[b]
        self._refs[b] += 1

    def _key(self, b: int, key: bytes) -> None:
        self._key_of[b] = key
        self._block_of[key] = b

    def _take(self, n: int, seq_id) -> list[int]:
        """``n`` private blocks: free ones (lowest id first), then evicted cached ones (least recent first)."""
        if n > self.available_blocks:
            raise CacheFullError(f"PagedKVCache: sequence {seq_id!r} needs {n} more blocks, only "
                                 f"{self.available_blocks} of {self.num_blocks} are free")
        from_free = min(n, len(self._free))
        taken = super()._take(from_free, seq_id)
        for _ in range(n - from_free):
            b, _ = self._lru.popitem(last=False)
            del self._block_of[self._key_of.pop(b)]
            taken.append(b)
        for b in taken:
            self._refs[b] = 1
        return taken

    def __repr__(self) -> str:
        return (f"BlockManager(layers={self.num_layers}, blocks={self.num_blocks}x{self.block_size}, "
                f"used={self.used_blocks}, cached={self.cached_blocks}, free={self.free_blocks}, "
                f"prefix_caching={self.enable_prefix_caching}, {self.nbytes / 2**20:.1f} MiB)")
