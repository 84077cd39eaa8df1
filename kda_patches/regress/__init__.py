"""A/B regression: run a workload with the overlay off and on, in fresh processes, and compare."""
