"""OpenAI-compatible LLM server for Apple MLX with batched speculative decoding."""

__version__ = "0.1.0"
