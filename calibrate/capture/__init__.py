"""Stage 3, capture: the attention hook that sees Q, K and V as vLLM caches them, and the mergeable statistics."""
