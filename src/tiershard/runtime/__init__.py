"""The sharding runtime: flat storage, units, hooks and the gradient path."""
