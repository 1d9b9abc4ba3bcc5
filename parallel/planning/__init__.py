"""Planning, pure and one-way: shapes -> schedules, stage plans, partition -> bytes and FLOPs -> stage costs ->
auto -> step costs -> layout -> run plan. It imports neither DeepSpeed nor torch.distributed, so the dry run and
the sweep report never load them (tests/test_import_contract.py checks both, on the source and in a subprocess)."""
