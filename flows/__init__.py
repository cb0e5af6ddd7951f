"""Prefect flows: thin, readable top to bottom; no torch import."""
