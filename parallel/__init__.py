"""Pipeline parallelism and recompute: the only package that imports DeepSpeed.

Three packages, imports flowing one way: `planning` (pure: no DeepSpeed, no torch.distributed) <- `runtime`
(DeepSpeed's engine running the plans) <- `measurement` (trace, meters, profiles). docs/ARCHITECTURE.md has the map.
"""
