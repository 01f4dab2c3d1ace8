"""Benchmarks: each script prints ratios against a peer measured in the same run; the last line is the headline."""
