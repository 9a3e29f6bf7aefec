"""The composition root: opening the device, probing it for policy defaults, and putting a
run (`run_workload`) or a comparison of policies together from the workload, the driver,
the replay loop and the result writer."""
