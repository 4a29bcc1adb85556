"""Fixtures: tiny random-weight models and the default real model (filled in by the models work)."""
