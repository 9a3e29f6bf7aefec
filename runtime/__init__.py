"""Requests, scheduling, budget policies, the engine loop, workloads, results and the CLI."""
