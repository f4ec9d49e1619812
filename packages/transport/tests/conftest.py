pytest_plugins = ["hybridkv.transport.testing"]
