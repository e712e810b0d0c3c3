"""Correct program (quiet batch quiet-r88b).

Ported from huggingface/transformers src/transformers/models/granite_speech/modeling_granite_speech.py
(installed 5.25.0; the port of IBM's Granite Speech conformer CTC encoder, ibm-granite/granite-speech-3.3-2b):
GraniteSpeechCTCEncoder.forward and GraniteSpeechConformerAttention.forward.

The encoder cuts every utterance into blocks of `context_size` frames and attends only inside a block (a
streaming-style block attention with Shaw relative positions, `attention_dists` clamped to the block).  When the
frame count is not a multiple of the block size the last block is right-padded up to `context_size`, and the
model masks that block's padded rows and columns in the relative-position bias (`pos_attn`) it hands to SDPA as
`attn_mask`.

Self-check: a tiny encoder built from GraniteSpeechEncoderConfig encodes two utterances of 23 frames with
context_size 8 (blocks 8, 8, 7); the reference re-runs every layer with the attention written as a double loop
over blocks and query frames, each query scoring only the real frames of its own block (no padding, no mask).
The outputs (mid-layer CTC softmax residual included) must agree.
"""
import math

import torch
from transformers import GraniteSpeechEncoderConfig
from transformers.models.granite_speech.modeling_granite_speech import GraniteSpeechCTCEncoder

torch.manual_seed(0)

config = GraniteSpeechEncoderConfig(
    input_dim=12,
    num_layers=2,
    hidden_dim=32,
    feedforward_mult=2,
    num_heads=4,
    output_dim=10,
    context_size=8,
    max_pos_emb=16,
    dropout=0.0,
    conv_kernel_size=5,
    conv_expansion_factor=2,
)
encoder = GraniteSpeechCTCEncoder(config).eval()

batch, num_frames = 2, 23
input_features = torch.randn(batch, num_frames, config.input_dim)

with torch.no_grad():
    out = encoder(input_features).last_hidden_state


def reference_attention(attn, hidden_states):
    """GraniteSpeechConformerAttention written per block and per query, on the real frames only."""
    hidden_states = attn.pre_norm(hidden_states)
    bsz, n, _ = hidden_states.shape
    q = attn.to_q(hidden_states).view(bsz, n, attn.num_heads, attn.dim_head)
    k, v = attn.to_kv(hidden_states).chunk(2, dim=-1)
    k = k.view(bsz, n, attn.num_heads, attn.dim_head)
    v = v.view(bsz, n, attn.num_heads, attn.dim_head)
    ctx = attn.context_size
    out = torch.zeros(bsz, n, attn.num_heads, attn.dim_head)
    for b in range(bsz):
        for start in range(0, n, ctx):
            block = list(range(start, min(start + ctx, n)))
            for i in block:
                for h in range(attn.num_heads):
                    scores = []
                    for j in block:
                        dist = max(-ctx, min(ctx, (i - start) - (j - start))) + attn.max_pos_emb
                        rel = attn.rel_pos_emb.weight[dist]
                        s = (q[b, i, h] @ k[b, j, h]) * attn.scale + (q[b, i, h] @ rel) * attn.scale
                        scores.append(s)
                    w = torch.softmax(torch.stack(scores), dim=0)
                    out[b, i, h] = sum(w[t] * v[b, j, h] for t, j in enumerate(block))
    return attn.to_out(out.reshape(bsz, n, -1))


def reference_encoder(hidden_states):
    hidden_states = encoder.input_linear(hidden_states)
    for idx, layer in enumerate(encoder.layers, start=1):
        hidden_states = 0.5 * layer.ff1(hidden_states) + hidden_states
        hidden_states = reference_attention(layer.attn, hidden_states) + hidden_states
        hidden_states = layer.conv(hidden_states) + hidden_states
        hidden_states = 0.5 * layer.ff2(hidden_states) + hidden_states
        hidden_states = layer.post_norm(hidden_states)
        if idx == encoder.num_layers // 2:
            mid = encoder.out(hidden_states)
            hidden_states = hidden_states + encoder.out_mid(torch.softmax(mid, dim=-1))
    return hidden_states


with torch.no_grad():
    ref = reference_encoder(input_features)

assert math.ceil(num_frames / config.context_size) == 3 and num_frames % config.context_size == 7
torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
print("granite speech block-context encoder matches the per-block double loop:", tuple(out.shape))
