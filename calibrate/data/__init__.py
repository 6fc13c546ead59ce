"""Stage 1, data: the user's files or Hub datasets → token sequences, with a manifest of what was read."""
