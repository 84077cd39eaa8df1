"""Environment bootstrap (placeholder until the bootstrap module lands)."""


def bootstrap_environment(flags):
    return None
