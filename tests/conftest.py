"""Shared pytest set-up: the `slurm_cluster` fixture (a real two-node Slurm on this machine)."""

pytest_plugins = ["tests.slurm_cluster"]
