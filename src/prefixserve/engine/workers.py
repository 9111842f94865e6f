"""One rank's share of the model (all ranks), and the worker processes of ranks 1..N-1.

Rank 0 is the engine: it schedules, builds each step's inputs and the attention batch, and
broadcasts them; every rank then runs the same forward on its own heads and its own KV chunks
(the chunk ids are the tree's, identical everywhere), and the logits are all-gathered for
rank 0 to sample. NCCL on GPUs (NVLink multicast left off), gloo on CPU. Workers are started by
the engine itself (no torchrun) and die with it, also when it crashes (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import socket

import torch
import torch.distributed as dist

from ..attention.base import AttentionBatch, AttentionShape, PaddedRows, create_backend
from ..config import EngineConfig
from ..kvcache.chunk_pool import ChunkPool
from ..model import loader
from ..model.parallel import TPGroup
from .cuda_graphs import DecodeGraphs

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_MEMORY = 1 << 30
# chunk_size defaults. CUDA: a 64-slot chunk is exactly one key tile of the attend kernel
# (one base address per tile); 16-slot chunks make every tile a gather over 4 chunks, which
# took 10-17% longer per launch on an H200 (Llama-2-7B dims, 1,024 x 16K shared + 64 own).
# The CPU reference path has no tiles, and small chunks put more boundaries under the tests.
CUDA_CHUNK_SIZE, CPU_CHUNK_SIZE = 64, 16
_SAFE_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclasses.dataclass
class RankState:
    """What every rank holds: its model shard, its KV pool shard and its attention backend."""

    tp: TPGroup
    device: torch.device
    dtype: torch.dtype
    source: loader.ModelSource
    model: torch.nn.Module
    pool: ChunkPool
    backend: object

    graphs: DecodeGraphs | None = None  # CUDA, one rank, unless enforce_eager

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                sample_rows: list[int]):
        """One step's forward; -> fp32 logits [len(sample_rows), vocab] or None."""
        rows = self.graphs.rows_for(batch) if self.graphs else None
        if rows is not None:
            batch = dataclasses.replace(batch, padded=PaddedRows(rows, self.pool.pad_slot))
        self.backend.plan(batch)
        run = lambda i, p: self.model(i, p, self.backend, self.pool.k, self.pool.v)  # noqa: E731
        if rows is None:
            hidden = run(self.upload(ids), self.upload(positions))
        else:
            hidden = self.graphs.run(rows, self.upload(ids), self.upload(positions),
                                     self.backend.generation, run)
        if not sample_rows:
            return None
        if sample_rows == list(range(len(sample_rows))):  # a decode step: the first rows
            return self.model.compute_logits(hidden[:len(sample_rows)])
        return self.model.compute_logits(hidden[self.upload(torch.tensor(sample_rows))])

    def upload(self, x: torch.Tensor) -> torch.Tensor:
        """Host -> device without waiting for the device (a pageable copy would sync)."""
        if self.device.type != "cuda" or x.device.type == "cuda":
            return x
        return x.pin_memory().to(self.device, non_blocking=True)


def build_rank(cfg: EngineConfig, tp: TPGroup) -> RankState:
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cuda and tp.size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {tp.size} exceeds the {torch.cuda.device_count()} visible GPUs")
    device = torch.device("cuda", tp.rank) if cuda else torch.device("cpu")
    dtype = _DTYPES.get(cfg.dtype) or (torch.bfloat16 if cuda else torch.float32)
    src = loader.resolve(cfg)
    model = loader.load_model(src, dtype, device, cfg.seed, tp)
    m = model.cfg
    kv_heads = tp.part(m.num_kv_heads, "num_kv_heads")
    chunk_size = cfg.cache.chunk_size or (CUDA_CHUNK_SIZE if cuda else CPU_CHUNK_SIZE)
    per_chunk = ChunkPool.bytes_per_chunk(m.num_layers, chunk_size, kv_heads, m.head_dim, dtype)
    memory = cfg.cache.kv_cache_memory
    if memory is None:
        memory = CPU_KV_CACHE_MEMORY if not cuda else int(0.9 * torch.cuda.mem_get_info(device)[0])
    num_chunks = torch.tensor([memory // per_chunk - 1])  # the pool adds its pad chunk
    if tp.size > 1:  # every rank must hold the same chunk ids
        num_chunks = num_chunks.to(device)
        dist.all_reduce(num_chunks, op=dist.ReduceOp.MIN)
    pool = ChunkPool(m.num_layers, int(num_chunks), chunk_size, kv_heads, m.head_dim, dtype, device)
    shape = AttentionShape(tp.part(m.num_heads, "num_heads"), kv_heads, m.head_dim, m.attn_scale,
                           dtype, device, m.sliding_window if m.sliding_layers else None)
    state = RankState(tp, device, dtype, src, model, pool, create_backend(cfg.attention_backend, shape))
    if cuda and not cfg.enforce_eager:
        if tp.size == 1:
            state.graphs = DecodeGraphs(device, cfg.scheduler.max_num_seqs)
        else:
            log.info("tensor parallel: decode steps run eagerly (CUDA graphs are single-GPU for now)")
    return state


class Workers:
    """Ranks 1..N-1 as processes; `start` also makes the calling process rank 0."""

    def __init__(self, cfg: EngineConfig):
        size = cfg.tensor_parallel_size
        if cfg.device != "cpu" and torch.cuda.is_available() and size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {size} exceeds the {torch.cuda.device_count()} visible GPUs")
        for k, v in _SAFE_NCCL_ENV.items():
            os.environ[k] = v
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_worker_main, args=(cfg, rank, size, port), daemon=True)
                      for rank in range(1, size)]
        for p in self.procs:
            p.start()
        _init_group(cfg, 0, size, port)

    def broadcast(self, inputs) -> None:
        dist.broadcast_object_list([inputs], src=0)

    def close(self) -> None:
        if not self.procs:
            return
        self.broadcast(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self.procs = []
        dist.destroy_process_group()

    def kill(self) -> None:
        """After a failed start: no collective is safe, so end the workers outright."""
        for p in self.procs:
            p.kill()
            p.join()
        self.procs = []


def _init_group(cfg: EngineConfig, rank: int, size: int, port: int) -> None:
    cuda = cfg.device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        log.warning("cannot ask to die with the engine process: workers may outlive a crash")


def _worker_main(cfg: EngineConfig, rank: int, size: int, port: int) -> None:
    _die_with_parent()
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    _init_group(cfg, rank, size, port)
    state = build_rank(cfg, TPGroup(rank, size))
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        state.forward(*box[0])
    dist.destroy_process_group()
