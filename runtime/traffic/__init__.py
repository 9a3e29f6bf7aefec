"""What a run is asked to do: workload files, arrival processes, trace files, and the
prompts and requests built from them."""
