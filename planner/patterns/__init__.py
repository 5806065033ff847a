"""The pattern library: small graphs of Paddle ops that the matcher looks for."""
