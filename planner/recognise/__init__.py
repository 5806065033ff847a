"""Recognition: the traced graph's blocks and sub-layers, their roles, and the SPMD replay that checks placements."""
