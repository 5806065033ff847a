"""Cost model: device profiles, FLOPs, memory and communication estimates."""
