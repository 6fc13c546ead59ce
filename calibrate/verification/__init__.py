"""Stage 6, verification: what each KV-cache scheme costs the model, verdicts, memory arithmetic, reports."""
