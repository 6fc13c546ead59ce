"""Stage 2, model: load and place a Hugging Face model, and describe its attention layers."""
