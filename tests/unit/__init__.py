"""The unit tier: pure tests that start no process and load no real model (`./run_tests.sh --fast`)."""
