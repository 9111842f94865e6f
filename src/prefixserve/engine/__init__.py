"""The engine: who owns what.

- `Request` / `Sequence` (request.py): CPU objects owned by the `Scheduler` from `add` until
  finished; a running sequence holds one path of the prefix tree (its `leaf`).
- The prefix tree: written only by the `Scheduler` (admission, growth, `on_launched`,
  `on_sampled`, pins); the model runner reads paths through `segments` / `slot`. Readers outside
  this package use `LLMEngine.stats()`.
- `SchedulerOutput` (scheduler.py): the step's grants, CPU, built by the scheduler and read by
  the model runner and the engine's postprocess; never kept past the step.
- The attention plan: device tensors owned by the attention backend, built by `plan()` from the
  `AttentionBatch` the model runner derives from the tree; layers only `run()`.
- The chunk pool's K/V tensors are owned by the pool; the prefix tree owns every allocated chunk
  (all but the pool's pad chunk, which the padding rows of a CUDA-graph step write).
- CUDA graphs (cuda_graphs.py): owned by each rank's `RankState`; they capture the plan's buffers
  and stay valid while the backend's `generation` is unchanged.
"""
