"""Benchmarks: datasets, kernel timing, offline throughput, online serving, plots."""
