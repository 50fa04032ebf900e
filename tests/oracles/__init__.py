"""Independent test oracles: dense, loop-based references that share no code with the runtime."""
