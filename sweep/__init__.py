"""Sweeps: many runs from one command. The Hydra multirun callback (`callback`), what a run does as one job of
a sweep (`job`: FAILED markers, skipping finished jobs on a relaunch, the W&B group), the SLURM launcher that
submits one job per combination (`slurm_launcher`) and the sweep's report (`report`).

Above harness/ (one run): it imports harness, never the other way round.
"""
