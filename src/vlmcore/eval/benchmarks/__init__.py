"""Public image and video benchmarks: records, task definitions, scoring."""
