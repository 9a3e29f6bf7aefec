"""The replay loop: a workload's requests submitted on the run's clock as they arrive, the
engine advanced, every iteration and request recorded; with the alarm that stops document
work at a chat's arrival, the stop signals, and the live progress it shows."""
