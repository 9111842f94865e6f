"""The chunk pool: K/V tensors for every layer and an O(1) free list of chunk ids.

A chunk is vLLM's block and ChunkAttention's chunk: `chunk_size` consecutive token slots of
K and V in every layer. The pool knows nothing of sequences or prefixes; the prefix tree owns
every allocated chunk. One more chunk, never handed out, follows the `num_chunks` usable ones:
the padding rows of a CUDA-graph step write their K/V to its first slot (`pad_slot`).

An fp8 pool (dtype float8_e4m3fn) also holds `scales` [L, 4, Hkv] fp32, its layers' fixed
quantization scales (`kvcache.scales`; rows as `attention.ops.reference` names them), set
once at start-up; a 16-bit pool has none.
"""

from __future__ import annotations

import torch


class OutOfChunks(Exception):
    """No free chunk and nothing evictable: the scheduler must preempt or wait."""


class ChunkPool:
    def __init__(self, num_layers: int, num_chunks: int, chunk_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        if num_chunks < 1:
            raise ValueError(f"the KV cache holds {num_chunks} chunks; give it more memory")
        shape = (num_layers, num_chunks + 1, chunk_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, N + 1, C, Hkv, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.scales = torch.ones((num_layers, 4, num_kv_heads), device=device) \
            if dtype == torch.float8_e4m3fn else None
        self.num_chunks, self.chunk_size = num_chunks, chunk_size
        self.pad_slot = num_chunks * chunk_size
        self._free = list(range(num_chunks - 1, -1, -1))  # a stack: lowest id handed out first

    @staticmethod
    def bytes_per_chunk(num_layers: int, chunk_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * chunk_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfChunks
        return self._free.pop()

    def free(self, chunk: int) -> None:
        self._free.append(chunk)

    def free_ids(self) -> list[int]:
        return list(self._free)
