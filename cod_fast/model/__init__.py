"""The policy model: loading a model folder or the built-in tiny Qwen3, attention over packed
sequences, lean activations, tokenizers, and `Policy` (the forward pass into the fused loss)."""
