"""Applying a plan's placements: validate it against the model, build the mesh, shard the parameters,
install the hooks, wrap the optimizer and the loader, and make the replicas start equal."""
