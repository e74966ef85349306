"""System checks (placeholder until the checks land)."""
