"""Getting a model: checkpoints, GGUF conversion, the tokenizer, the default model, random
weights; `loader.load_model` is the one entry point."""
