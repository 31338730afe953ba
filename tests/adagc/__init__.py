"""adagc against its float64 restatement."""
