def pytest_configure(config):
    # The repository's pytest configuration declares it too; a copy of this folder has none.
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
