"""Placement decisions as pure functions: where layers go, how big batches are, what a job costs."""
