"""Stage 4, scales: statistics → FP8 scales (the observers), and the output-aware search."""
