"""Fixtures: a throwaway PostgreSQL server (filled in by the storage work)."""
