"""pytest plugin (placeholder until the regress module lands)."""
