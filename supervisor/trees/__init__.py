"""Process trees: every process below a supervised one (the proc connector, the
tree keeper, the guardian) and the adoption of engine-spawned workers."""
