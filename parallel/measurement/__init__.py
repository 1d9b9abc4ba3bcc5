"""What a run measures: the per-instruction trace, activation bytes through saved-tensor hooks, peak live tensor
bytes from the allocator's events, the device profile's curves, and every stage in one process for benchmarks
and tests."""
