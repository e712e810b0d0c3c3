"""transformers flash-attention path: the sliding window handed to flash_attn was one token too wide.

Citation: huggingface/transformers#40163 (fixes issue huggingface/transformers#39408),
src/transformers/modeling_flash_attention_utils.py, ``_flash_attention_forward``.

The bug: ``flash_kwargs = {"window_size": (sliding_window, sliding_window)}``. flash_attn reads
``window_size=(left, right)`` as "query i attends keys in [i - left, i + right] inclusive", so a
sliding layer saw ``sliding_window + 1`` keys, while the sdpa/eager masks (and the models' training)
use ``sliding_window`` keys including the query itself. Prefill longer than the window differs
between attention implementations.

The fix: ``flash_kwargs = {"window_size": (sliding_window - 1, sliding_window - 1)}``.

This program keeps the transformers layout (a Mistral-style attention module that calls the
``flash_attention_2`` interface function, which transposes to (batch, seq, heads, dim) and calls
``_flash_attention_forward`` with ``sliding_window=module.sliding_window``). The flash_attn kernel
is not available on CPU, so ``flash_attn_func`` below is a plain-torch stand-in with the kernel's
documented ``causal`` (bottom-right aligned) and ``window_size`` semantics. Toy sizes, random
weights, ``sliding_window`` 4, a 12-token prompt, greedy decoding by re-running the full prefix.
"""

import math
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import MistralConfig
from transformers.models.mistral.modeling_mistral import (
    MistralMLP,
    MistralRMSNorm,
    MistralRotaryEmbedding,
    apply_rotary_pos_emb,
)

FIXED = "--fixed" in sys.argv

_flash_supports_window_size = True


# --- stand-in for flash_attn.flash_attn_func (CPU) -------------------------------------------
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, deterministic=False):
    """q: (batch, seqlen_q, nheads, d), k/v: (batch, seqlen_k, nheads_k, d)."""
    bsz, seqlen_q, nheads, d = q.shape
    seqlen_k = k.shape[1]
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    if k.shape[2] != nheads:
        rep = nheads // k.shape[2]
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    row = torch.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    col = torch.arange(seqlen_k)[None, :]
    left, right = window_size
    if causal:
        right = 0
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if right >= 0:
        allowed &= col <= row + right
    if left >= 0:
        allowed &= col >= row - left
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


# --- transformers.modeling_flash_attention_utils ---------------------------------------------
def _flash_attention_forward(
    query_states: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    query_length: int,
    is_causal: bool,
    dropout: float = 0.0,
    position_ids: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    sliding_window: Optional[int] = None,
    use_top_left_mask: bool = False,
    softcap: Optional[float] = None,
    deterministic: Optional[bool] = None,
    **kwargs,
):
    if not use_top_left_mask:
        causal = is_causal
    else:
        causal = is_causal and query_length != 1

    # Assuming 4D tensors, key_states.shape[1] is the key/value sequence length (source length).
    use_sliding_windows = (
        _flash_supports_window_size and sliding_window is not None and key_states.shape[1] > sliding_window
    )
    if FIXED:
        # Flash attention expects window size to be reduced by 1 for proper indexing
        flash_kwargs = {"window_size": (sliding_window - 1, sliding_window - 1)} if use_sliding_windows else {}
    else:
        flash_kwargs = {"window_size": (sliding_window, sliding_window)} if use_sliding_windows else {}

    if deterministic is not None:
        flash_kwargs["deterministic"] = deterministic
    if softcap is not None:
        flash_kwargs["softcap"] = softcap

    # (no padding in this batch: the dense flash_attn_func path)
    attn_output = flash_attn_func(
        query_states, key_states, value_states, dropout, softmax_scale=softmax_scale, causal=causal, **flash_kwargs
    )
    return attn_output


# --- transformers.integrations.flash_attention ----------------------------------------------
def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, softcap=None, **kwargs):
    seq_len = query.shape[2]
    # FA2 uses non-transposed inputs
    query = query.transpose(1, 2)
    key = key.transpose(1, 2)
    value = value.transpose(1, 2)
    is_causal = kwargs.pop("is_causal", None)
    if is_causal is None:
        is_causal = module.is_causal
    attn_output = _flash_attention_forward(
        query, key, value, attention_mask,
        query_length=seq_len,
        is_causal=is_causal,
        dropout=dropout,
        softmax_scale=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        use_top_left_mask=False,
        **kwargs,
    )
    return attn_output, None


# --- a Mistral-style model ---------------------------------------------------------------------
class MistralAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        attention_interface = flash_attention_forward  # config._attn_implementation == "flash_attention_2"
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=getattr(self.config, "sliding_window", None),
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class MistralDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = MistralAttention(config, layer_idx)
        self.mlp = MistralMLP(config)
        self.input_layernorm = MistralRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = MistralRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


class MistralForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([MistralDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = MistralRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MistralRotaryEmbedding(config=config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None):
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        # flash_attention_2: the 2D mask is passed through (None when there is no padding)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask)
        return self.lm_head(self.norm(hidden_states))


def main():
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
        max_position_embeddings=64,
    )
    config._attn_implementation = "flash_attention_2"
    model = MistralForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)

    input_ids = torch.randint(0, config.vocab_size, (2, 12))
    with torch.no_grad():
        logits = model(input_ids)
        print("last-token logits[:, :6]:", logits[:, -1, :6].round(decimals=4).tolist())
        generated = input_ids
        for _ in range(6):
            next_tok = model(generated)[:, -1].argmax(-1, keepdim=True)
            generated = torch.cat([generated, next_tok], dim=1)
    print("generated:", generated[:, input_ids.shape[1]:].tolist())


if __name__ == "__main__":
    main()
