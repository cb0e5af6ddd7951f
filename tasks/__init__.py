"""Prefect tasks: each one observable side effect of the pipeline."""
