"""GPT-2 decoder with cross-attention that overwrites the encoder padding mask with None.

Citation: huggingface/transformers#47946 ("[GPT2] Fix encoder_attention_mask being silently
discarded in cross-attention", merged 2026-08). I read the PR description, not its diff.

Bug: in `GPT2Model.forward` a line `encoder_attention_mask = None` (introduced by the mask
refactor #42848) ran before the cross-attention mask was built with
`create_bidirectional_mask(..., attention_mask=encoder_attention_mask, encoder_hidden_states=...)`,
so the user's encoder padding mask was dropped and every decoder token attended to the padded
encoder positions (SDPA called with attn_mask=None in cross-attention).

Fix: delete the overwriting line, so the caller's `encoder_attention_mask` reaches the
cross-attention mask builder.

Reproduction: plain torch after modeling_gpt2.py (config with `add_cross_attention=True`,
GPT2Attention with `q_attn` for the cross-attention, `create_causal_mask` /
`create_bidirectional_mask`), random weights. A batch of two encoder outputs, the second one
right padded (its `encoder_attention_mask` has zeros), is decoded with teacher forcing.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class GPT2Config:
    vocab_size: int = 80
    n_positions: int = 64
    n_embd: int = 32
    n_layer: int = 2
    n_head: int = 4
    add_cross_attention: bool = True
    layer_norm_epsilon: float = 1e-5


def create_causal_mask(config, inputs_embeds, attention_mask):
    batch, length = inputs_embeds.shape[:2]
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None].expand(batch, 1, length, length)
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, None, :]
    return mask


def create_bidirectional_mask(config, inputs_embeds, attention_mask, encoder_hidden_states):
    """(batch, 1, q, kv) boolean mask over the encoder keys, or None when nothing is padded."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    q_len = inputs_embeds.shape[1]
    return attention_mask.bool()[:, None, None, :].expand(-1, 1, q_len, -1)


class GPT2Attention(nn.Module):
    def __init__(self, config, is_cross_attention=False):
        super().__init__()
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.split_size = self.embed_dim
        if is_cross_attention:
            self.c_attn = nn.Linear(self.embed_dim, 2 * self.embed_dim)
            self.q_attn = nn.Linear(self.embed_dim, self.embed_dim)
        else:
            self.c_attn = nn.Linear(self.embed_dim, 3 * self.embed_dim)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        is_cross_attention = encoder_hidden_states is not None
        if is_cross_attention:
            query_states = self.q_attn(hidden_states)
            key_states, value_states = self.c_attn(encoder_hidden_states).split(self.split_size, dim=2)
            attention_mask = encoder_attention_mask
        else:
            query_states, key_states, value_states = self.c_attn(hidden_states).split(self.split_size, dim=2)
        query_states = query_states.view(*query_states.shape[:-1], -1, self.head_dim).transpose(1, 2)
        key_states = key_states.view(*key_states.shape[:-1], -1, self.head_dim).transpose(1, 2)
        value_states = value_states.view(*value_states.shape[:-1], -1, self.head_dim).transpose(1, 2)
        attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states, attn_mask=attention_mask)
        attn_output = attn_output.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)
        return self.c_proj(attn_output)


class GPT2Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        if config.add_cross_attention:
            self.crossattention = GPT2Attention(config, is_cross_attention=True)
            self.ln_cross_attn = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, hidden_states, attention_mask, encoder_hidden_states=None, encoder_attention_mask=None):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), attention_mask=attention_mask)
        if encoder_hidden_states is not None:
            hidden_states = hidden_states + self.crossattention(
                self.ln_cross_attn(hidden_states),
                encoder_hidden_states=encoder_hidden_states,
                encoder_attention_mask=encoder_attention_mask,
            )
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList([GPT2Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        inputs_embeds = self.wte(input_ids)
        position_ids = torch.arange(inputs_embeds.shape[1]).unsqueeze(0)
        hidden_states = inputs_embeds + self.wpe(position_ids)

        causal_mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask)

        # If a 2D or 3D attention mask is provided for the cross-attention
        # we need to make broadcastable to [batch_size, num_heads, seq_length, seq_length]
        if not FIXED:
            encoder_attention_mask = None
        if encoder_hidden_states is not None:
            encoder_attention_mask = create_bidirectional_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=encoder_attention_mask,
                encoder_hidden_states=encoder_hidden_states,
            )

        for block in self.h:
            hidden_states = block(hidden_states, causal_mask, encoder_hidden_states,
                                  encoder_attention_mask=encoder_attention_mask)
        return self.ln_f(hidden_states)


def main():
    torch.manual_seed(0)
    config = GPT2Config()
    model = GPT2Model(config).eval()
    # Encoder outputs of a padded source batch (e.g. from a BERT encoder in an EncoderDecoderModel).
    encoder_hidden_states = torch.randn(2, 9, config.n_embd)
    encoder_attention_mask = torch.tensor([[1] * 9, [1] * 5 + [0] * 4])
    input_ids = torch.randint(0, config.vocab_size, (2, 6))
    attention_mask = torch.ones(2, 6, dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, encoder_hidden_states=encoder_hidden_states,
                    encoder_attention_mask=encoder_attention_mask)
    print("decoder states", tuple(out.shape), "row1 first token %.4f" % out[1, 0, :4].sum().item())


if __name__ == "__main__":
    main()
