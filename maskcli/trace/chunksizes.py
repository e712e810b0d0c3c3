"""The chunk sizes a streaming model states beside its own causal flag (checks/own.py's causal-flag-ignored).

A streaming speech encoder that states itself causal (icefall's `Zipformer(causal=True)`, WeNet's and SpeechBrain's
dynamic chunk training) means chunk-causal: each frame sees its whole chunk, later frames of it included, and the
chunks before it. Its own `chunk_size` (an int, or the sizes training draws from: Zipformer's `chunk_size=(16, 32,
64, -1)`, where -1 or 0 means the whole utterance) says how long a call may be and still see every key: a streaming
step of one chunk masks nothing, and is causal as the model means it.
"""

from __future__ import annotations

CHUNKS = ("chunk_size", "chunk_sizes", "static_chunk_size", "decoding_chunk_size", "decode_chunk_size", "chunk_len",
          "chunk_length")


def chunk_sizes(module) -> dict:
    """{"model_chunks": (sizes, 'Class.name')} of the module's own int or tuple / list of int chunk sizes, else {}."""
    own = vars(module)
    for name in CHUNKS:
        value = own.get(name)
        sizes = (value,) if type(value) is int else tuple(value) if isinstance(value, (tuple, list)) and value \
            and all(type(v) is int for v in value) else None
        if sizes is not None:
            return {"model_chunks": (sizes, f"{type(module).__name__}.{name}")}
    return {}
