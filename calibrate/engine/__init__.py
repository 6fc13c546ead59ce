"""Running the vLLM that will serve: launching it in its own interpreter, and what it reports."""
