"""Offline phase: load -> trace -> graph -> match -> cost/search -> emit, and the autodist-plan CLI."""
