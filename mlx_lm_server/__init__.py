"""OpenAI-compatible LLM server for Apple MLX with batched speculative decoding."""

import os as _os

__version__ = "0.1.0"

# MLX's CUDA backend raises "Cache thrashing" once a thread has built 512
# attention graphs (a cuDNN graph per prompt shape), which would end a server
# that has simply seen many prompt lengths; with the check off its cache of
# graphs only evicts. Read when MLX first uses the GPU; a user's value stays.
_os.environ.setdefault("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")
