"""Reading results: latency metrics, run folders, paired comparisons, reports and plots."""
