"""Native PyTorch models of the Llama family (Llama, Qwen2, Qwen3, Mistral) over a paged KV pool."""
