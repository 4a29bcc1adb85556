"""The cluster tier: tests that start processes (stages, brokers, CLI runs, Slurm, Prometheus, tmux...)."""
