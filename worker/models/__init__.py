"""Model families on the shared layers (`worker/layers/`).

The contract the engine uses (see ARCHITECTURE.md, "The model contract"):
`registry.build_model`, `config.ModelConfig`, `step.StepInput`, `worker.layers.kv.KVCache`,
`worker.loading.random_init.init_random_weights`.
"""
