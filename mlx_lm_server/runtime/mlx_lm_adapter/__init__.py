"""The one door to mlx-lm's internals (names that are not its public API).

mlx-lm's internals move between releases (the package pins the exact
version). Everything here is covered by ``tests/model/test_upstream_adapter.py``,
which fails loudly when an attribute this folder relies on disappears, and
fails on any private name used outside it. Three rooms: ``accessors.py``
(upstream's private state read and written), ``patches.py`` (what changes
how upstream's classes behave, in place) and ``positions.py`` (a tree
pass's positions per token, a prompt's M-RoPE positions). A new mlx-lm
release is checked by reading this folder.
"""

from .accessors import (  # noqa: F401
    load_model_lazily,
    load_tokenizer,
    hf_tokenizer,
    sequences_in_generator,
    write_index,
    set_write_index,
    has_pending_right_padding,
    batch_cache_as,
    rotating_state,
    rotating_cache,
    recurrent_states,
    set_recurrent_states,
    set_pass_lengths,
    cache_mixers,
    record_calls,
    bind_call,
    GenerationResponse,
    generation_stream,
    generation_batch,
    prompt_tokens_processed,
    next_within_cap,
    plain_step,
    pending_tokens,
    pending_logprobs,
    set_pending,
    record_fed_tokens,
    count_and_match,
    tokens_left,
    calls_are_json_objects,
    keep_leading_space,
    text_model,
    text_args,
    token_embedding,
    output_projection,
    model_module,
    keeps_dtype,
    full_attention_layer,
    sanitized_layer,
    attention,
    rope,
    attention_mask,
)
from .patches import (  # noqa: F401
    install_generation_step,
    attend_through_caches,
    LinearSearchTrie,
    linear_search,
    HiddenCapture,
    capture_hidden,
    release_capture,
)
from .positions import (  # noqa: F401
    node_positions,
    node_positions_refused,
    grid_positions,
    grid_refused,
)
