"""What the tests share and that holds no test: fixture modules (fixtures_*.py, named in tests/conftest.py's
`pytest_plugins` or imported by name), tiny models and references, and the helpers several test modules use."""
