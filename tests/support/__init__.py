"""What the test modules share, declared once: fixtures registered as pytest plugins by tests/conftest.py
(redis_fixture, redis_cluster_fixture, auth_fixture, mooncake_fixture) and helpers imported by name (the running
app, the connector harness, tiny models, fact texts, ...). No test module imports another test module."""
