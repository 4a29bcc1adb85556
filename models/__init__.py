"""Reading model directories: config, safetensors headers, tokenizer, the default model, GGUF import."""
