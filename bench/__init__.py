"""Benchmarks. Their own process is the broker (and runs the baselines): its OpenMP threads wait as every
`layerbus` command's do (models/openmp_waits.py), set here before a benchmark that imports this package
first loads torch; those that load torch earlier set it themselves."""

from layerbus.models.openmp_waits import prefer_passive_waits

prefer_passive_waits()
