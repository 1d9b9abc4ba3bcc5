"""Pipeline parallelism and recompute: the only package that imports DeepSpeed.

Planning, pure and one-way (shapes -> bytes, FLOPs, schedule, partition -> stage costs -> auto -> layout ->
run plan), then what runs it: the recompute code, the PipelineModule, the engine and its config, the
activation meter, and every stage in one process for benchmarks and tests. docs/ARCHITECTURE.md has the map.
"""
