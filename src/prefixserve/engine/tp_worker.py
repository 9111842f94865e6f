"""The entry point of a tensor-parallel worker: `python -m prefixserve.engine.tp_worker`.

A module entry point, not multiprocessing's spawn: spawn re-imports the launcher's `__main__`,
which fails for scripts read from standard input, `python -c` and notebooks (the worker dies at
once and rank 0 would wait in the rendezvous forever). The launcher (workers.py) writes
`WorkerArgs` pickled to standard input and reads this process's stderr tail if it dies.

Start-up order, which rank 0 watches step by step: die with the parent (PR_SET_PDEATHSIG),
join the store (`joined/<rank>`), the process group, build the rank (its heap frozen:
heap.py), then serve steps.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys

import torch
import torch.distributed as dist

from ..model.parallel import TPGroup
from . import heap
from .workers import WorkerArgs, build_rank, init_group, joined_key, store_timeout


def _die_with_parent(parent_pid: int) -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit("tp_worker: the engine process is gone")


def main() -> None:
    args: WorkerArgs = pickle.load(sys.stdin.buffer)
    _die_with_parent(args.parent_pid)
    torch.set_num_threads(max(1, torch.get_num_threads() // args.size))
    store = dist.TCPStore("127.0.0.1", args.store_port, args.size, is_master=False,
                          timeout=store_timeout(args.cfg))
    store.set(joined_key(args.rank), "1")
    init_group(args.cfg, args.rank, args.size, store)
    state = build_rank(args.cfg, TPGroup(args.rank, args.size, args.cfg.deterministic))
    heap.freeze()
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        state.forward(*box[0])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
