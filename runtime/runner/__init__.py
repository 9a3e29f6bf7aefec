"""Carrying out a run: opening the device, probing it for policy defaults, replaying a
workload in real time, live progress, and writing the result files."""
