"""The model: its config (config.json or GGUF metadata), weights (safetensors or GGUF, dequantized),
and the Llama-family decoder that runs one merged step over the flat token batch."""
