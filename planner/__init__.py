"""Offline phase: load -> trace -> graph -> recognise -> cost/search -> emit, and the autodist-plan CLI."""
