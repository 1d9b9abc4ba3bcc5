"""What a run measures: the per-instruction trace, activation bytes through saved-tensor hooks, peak live tensor
bytes from the allocator's events, the device profile's curves, the prices of the run's own stage timed by its
replay, and every stage in one process for benchmarks and tests."""
