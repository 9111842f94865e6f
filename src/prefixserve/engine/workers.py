"""One rank's share of the model (all ranks), and the worker processes of ranks 1..N-1.

Rank 0 is the engine: it schedules, builds each step's inputs and the attention batch, and
broadcasts them; every rank then runs the same forward on its own heads and its own KV chunks
(the chunk ids are the tree's, identical everywhere), and the logits are all-gathered for
rank 0 to sample. NCCL on GPUs (NVLink multicast left off), gloo on CPU. Workers are started by
the engine itself (no torchrun) as `python -m prefixserve.engine.tp_worker` and die with it,
also when it crashes (PR_SET_PDEATHSIG).

Rank 0 watches them from the first moment: it owns the rendezvous store and waits for every
worker's `joined/<rank>` key while polling the processes, so a worker that exits before the
rendezvous, or has not joined within `tp_join_timeout` seconds, ends the start with
`WorkerError` naming the rank, its exit code and its stderr's tail. A worker that dies later
breaks the next collective; `Workers.failure` then names it the same way and ends the rest.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from typing import IO, TYPE_CHECKING

import torch
import torch.distributed as dist

from ..attention import create_backend
from ..attention.base import AttentionBackend, AttentionBatch, AttentionShape, PaddedRows
from ..config import EngineConfig
from ..kvcache import scales
from ..kvcache.chunk_pool import ChunkPool
from ..model import loader
from ..model.parallel import TPGroup
from .cuda_graphs import DecodeGraphs

if TYPE_CHECKING:
    from ..model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_MEMORY = 1 << 30
# chunk_size defaults. CUDA: a 64-slot chunk is exactly one key tile of the attend kernel
# (one base address per tile); 16-slot chunks make every tile a gather over 4 chunks, which
# took 10-17% longer per launch on an H200 (Llama-2-7B dims, 1,024 x 16K shared + 64 own).
# The CPU reference path has no tiles, and small chunks put more boundaries under the tests.
CUDA_CHUNK_SIZE, CPU_CHUNK_SIZE = 64, 16
# deterministic mode's key cells (attention/cells.py): a multiple of the GPU kernels' key tile
# (64 or 128 positions). A cell that sharing splits is read per sequence, a whole one once per
# step; every cell costs each of its rows a partial (written, merged). On an H100 (Llama-2-7B,
# 1,024 samples of a 2,048-token prompt) 256-key cells made the decode step 1.75x the default's
# mostly in partials and short programs; 1,024-key cells give a 2K prefix 2 partials a row.
CUDA_CELL, CPU_CELL = 1024, 64
_SAFE_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
STDERR_TAIL_BYTES = 2000
EXIT_GRACE_S = 5.0  # after a failed collective, how long a dying worker gets to be seen dead


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or never joined; the engine cannot go on."""


@dataclasses.dataclass
class RankState:
    """What every rank holds: its model shard, its KV pool shard and its attention backend."""

    tp: TPGroup
    device: torch.device
    dtype: torch.dtype
    source: loader.ModelSource
    model: LlamaForCausalLM  # every family's class subclasses it (model/registry.py)
    pool: ChunkPool
    backend: AttentionBackend

    graphs: DecodeGraphs | None = None  # CUDA, one rank, unless enforce_eager

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                sample_rows: list[int]) -> torch.Tensor | None:
        """One step's forward; -> fp32 logits [len(sample_rows), vocab] or None."""
        graphs = self.graphs
        rows = graphs.rows_for(batch) if graphs else None
        if rows is not None:
            batch = dataclasses.replace(batch, padded=PaddedRows(rows, self.pool.pad_slot))
        self.backend.plan(batch)

        def run(i: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.model(i, p, self.backend, self.pool.k, self.pool.v,
                                           self.pool.scales)  # hidden [T, hidden]
            return out

        if graphs is None or rows is None:
            hidden = run(self.upload(ids), self.upload(positions))
        else:
            hidden = graphs.run(rows, self.upload(ids), self.upload(positions), self.backend.generation, run)
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
    kv_dtype = kv_cache_dtype(cfg, device, dtype)
    per_chunk = ChunkPool.bytes_per_chunk(m.num_layers, chunk_size, kv_heads, m.head_dim, kv_dtype)
    memory = cfg.cache.kv_cache_memory
    if memory is None:
        memory = CPU_KV_CACHE_MEMORY if not cuda else int(0.9 * torch.cuda.mem_get_info(device)[0])
    num_chunks = torch.tensor([memory // per_chunk - 1])  # the pool adds its pad chunk
    if tp.size > 1:  # every rank must hold the same chunk ids
        num_chunks = num_chunks.to(device)
        dist.all_reduce(num_chunks, op=dist.ReduceOp.MIN)
    pool = ChunkPool(m.num_layers, int(num_chunks), chunk_size, kv_heads, m.head_dim, kv_dtype, device)
    cell = (CUDA_CELL if cuda else CPU_CELL) if cfg.deterministic else None
    shape = AttentionShape(tp.part(m.num_heads, "num_heads"), kv_heads, m.head_dim, m.attn_scale,
                           dtype, device, m.sliding_window if m.sliding_layers else None, cell,
                           None if kv_dtype == dtype else kv_dtype)
    if pool.scales is not None:
        scales.calibrate(pool, model, shape, loader.load_tokenizer(src, cfg.tokenizer))
    state = RankState(tp, device, dtype, src, model, pool, create_backend(cfg.attention_backend, shape))
    if cuda and not cfg.enforce_eager:
        if tp.size == 1:
            state.graphs = DecodeGraphs(device, cfg.scheduler.max_num_seqs)
        else:
            log.info("tensor parallel: decode steps run eagerly (CUDA graphs are single-GPU for now)")
    return state


def kv_cache_dtype(cfg: EngineConfig, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's, or e4m3 for `kv_cache_dtype` fp8 (on CUDA, a
    GPU with fp8 conversions: compute capability 8.9 or newer)."""
    if cfg.cache.kv_cache_dtype == "auto":
        return dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"kv_cache_dtype {cfg.cache.kv_cache_dtype!r} needs a GPU of compute capability 8.9 or "
                         f"newer (this one: {torch.cuda.get_device_capability(device)}); use kv_cache_dtype='auto'")
    return torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class WorkerArgs:  # what a worker reads from its standard input (tp_worker.py)
    cfg: EngineConfig
    rank: int
    size: int
    store_port: int
    parent_pid: int


def joined_key(rank: int) -> str:
    return f"joined/{rank}"


class Workers:
    """Ranks 1..N-1 as processes; `__init__` also makes the calling process rank 0."""

    def __init__(self, cfg: EngineConfig):
        size = cfg.tensor_parallel_size
        if cfg.device != "cpu" and torch.cuda.is_available() and size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {size} exceeds the {torch.cuda.device_count()} visible GPUs")
        for k, v in _SAFE_NCCL_ENV.items():
            os.environ[k] = v
        self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                   timeout=store_timeout(cfg))
        self.procs: list[subprocess.Popen[bytes]] = []
        self._stderr: dict[int, IO[bytes]] = {}  # pid -> the worker's stderr file
        try:
            for rank in range(1, size):
                self._start(WorkerArgs(cfg, rank, size, self.store.port, os.getpid()))
            self._wait_joined(cfg.tp_join_timeout)
            init_group(cfg, 0, size, self.store)
        except BaseException:
            self.kill()
            raise

    def _start(self, args: WorkerArgs) -> None:
        src = str(pathlib.Path(__file__).resolve().parents[2])  # this prefixserve, whatever sys.path says
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
        err = tempfile.TemporaryFile()
        proc = subprocess.Popen([sys.executable, "-m", "prefixserve.engine.tp_worker"], stdin=subprocess.PIPE,
                                stderr=err, env=env)
        self.procs.append(proc)
        self._stderr[proc.pid] = err
        assert proc.stdin is not None  # stdin=PIPE
        proc.stdin.write(pickle.dumps(args))
        proc.stdin.close()

    def _wait_joined(self, timeout: float) -> None:
        keys = {joined_key(r): r for r in range(1, len(self.procs) + 1)}
        deadline = time.monotonic() + timeout
        while not self.store.check(list(keys)):
            if dead := self._dead():
                raise WorkerError("tensor-parallel start failed: " + "; ".join(dead))
            if time.monotonic() > deadline:
                missing = [r for k, r in keys.items() if not self.store.check([k])]
                raise WorkerError(f"tensor-parallel ranks {missing} did not join within {timeout:g} s "
                                  f"(tp_join_timeout)")
            time.sleep(0.05)

    def _dead(self) -> list[str]:
        """'rank R exited with CODE: <stderr tail>' for each worker that has exited."""
        return [self._describe(rank, p) for rank, p in enumerate(self.procs, 1) if p.poll() is not None]

    def _describe(self, rank: int, proc: subprocess.Popen[bytes]) -> str:
        err = self._stderr[proc.pid]
        err.seek(max(0, err.seek(0, os.SEEK_END) - STDERR_TAIL_BYTES))
        tail = err.read().decode("utf-8", "replace").strip()
        code = proc.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"rank {rank} (pid {proc.pid}) {how}" + (f"; its stderr ends:\n{tail}" if tail else "")

    def failure(self, error: BaseException) -> WorkerError:
        """After a step failed: name the dead worker (waiting up to EXIT_GRACE_S for it to be
        seen dead), end every worker, and return the error to raise."""
        deadline = time.monotonic() + EXIT_GRACE_S
        while not (dead := self._dead()) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.kill()
        return WorkerError("tensor parallelism failed: " + ("; ".join(dead) or f"a step raised {error!r}"))

    def broadcast(self, inputs: object) -> None:
        """Send one step's inputs (or None: stop) to every worker (pickled)."""
        dist.broadcast_object_list([inputs], src=0)

    def close(self) -> None:
        if not self.procs:
            return
        self.broadcast(None)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._forget()
        dist.destroy_process_group()

    def kill(self) -> None:
        """After a failure: no collective is safe, so end the workers outright."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self._forget()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _forget(self) -> None:
        for err in self._stderr.values():
            err.close()
        self.procs, self._stderr = [], {}


def store_timeout(cfg: EngineConfig) -> datetime.timedelta:
    """Of the store's own operations; the join deadline is `_wait_joined`'s, which polls."""
    return datetime.timedelta(seconds=max(60.0, cfg.tp_join_timeout))


def init_group(cfg: EngineConfig, rank: int, size: int, store: dist.Store) -> None:
    cuda = cfg.device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=size)
