"""The run: start-up checks, the training loop and its outputs (files and W&B)."""
