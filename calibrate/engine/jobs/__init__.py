"""Scripts run by vLLM's own interpreter (engine/launch.py), never imported by kvcal: each imports only vLLM, torch,
the standard library and ``jobkit`` beside it."""
