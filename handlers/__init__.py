"""Example apps used by the README, `make demo` and the acceptance tests."""
