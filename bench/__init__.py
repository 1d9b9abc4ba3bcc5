"""Benchmarks that print figures (never timed tests): `python -m bench.recompute_bench`, `bench.peer_bench`,
`bench.auto_bench`. Their latest output is in docs/."""
