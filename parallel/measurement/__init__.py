"""What a run measures: the per-instruction trace, activation bytes through saved-tensor hooks, peak live tensor
bytes from the allocator's events, the recompute profile's costs, and every stage in one process for benchmarks
and tests."""
