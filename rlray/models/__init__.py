"""Model registry: where a model's weights and tokenizer come from."""
