"""Stage 5, checkpoint: write the scales into a checkpoint vLLM loads, read them back as vLLM does, inspect."""
