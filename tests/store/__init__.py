"""The store's tests: the contract suite and every test that runs on both SQLite and PostgreSQL; the SQLite
cases are unit tests, the PostgreSQL ones start a throwaway server (marked `postgres` and `cluster`)."""
