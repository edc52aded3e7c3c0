"""Prefect tasks: orchestration around training/ (subprocesses, caching, retries, artifacts)."""
