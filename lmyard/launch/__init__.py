"""Launching stages: the follower and its jobs (local torchrun, Docker containers), the stage image."""
