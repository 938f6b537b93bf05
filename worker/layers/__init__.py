"""Layers the model families share: attention over the KV cache, norms, MLP, decoder
layers, rotary embeddings, the KV cache."""
