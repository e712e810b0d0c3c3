"""A diffusers-style transformer block (diffusers' BasicTransformerBlock with its Attention / AttnProcessor2_0,
models/attention.py and attention_processor.py) for an autoregressive video / audio denoiser: `attn1` is the
self-attention over the latent frames, `attn2` the cross-attention to the text encoder's states. The block builds
both Attention modules from one set of keyword arguments, `causal=True` among them, as such blocks do; the processor
applies it only where the module attends to itself: `is_causal=attn.causal and encoder_hidden_states is None`.

So attn2 holds `causal=True` and rightly attends to every text token (its keys are the prompt, not later frames):
its processor is handed another sequence (`encoder_hidden_states`, the prompt), and a causal word on a
cross-attention says nothing about its memory. attn1 is causal, as stated. (This port keeps no
`is_cross_attention` attribute, as diffusers' Attention does: the argument alone says which call is which.)"""
import torch
import torch.nn.functional as F
from torch import nn


class AttnProcessor2_0:
    def __call__(self, attn, hidden_states, encoder_hidden_states=None):
        batch, length, _ = hidden_states.shape
        is_self = encoder_hidden_states is None
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        query = attn.to_q(hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)
        head_dim = query.shape[-1] // attn.heads
        query = query.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=attn.causal and is_self)
        return attn.to_out(out.transpose(1, 2).reshape(batch, length, -1))


class Attention(nn.Module):
    def __init__(self, query_dim, cross_attention_dim=None, heads=2, dim_head=8, causal=False):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.causal = heads, causal
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(cross_attention_dim or query_dim, inner, bias=False)
        self.to_v = nn.Linear(cross_attention_dim or query_dim, inner, bias=False)
        self.to_out = nn.Linear(inner, query_dim)
        self.processor = AttnProcessor2_0()

    def forward(self, hidden_states, encoder_hidden_states=None):
        return self.processor(self, hidden_states, encoder_hidden_states)


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim=16, cross_attention_dim=24, causal=True):
        super().__init__()
        kwargs = dict(heads=2, dim_head=8, causal=causal)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn1 = Attention(dim, **kwargs)
        self.attn2 = Attention(dim, cross_attention_dim=cross_attention_dim, **kwargs)

    def forward(self, hidden_states, encoder_hidden_states):
        hidden_states = hidden_states + self.attn1(self.norm1(hidden_states))
        return hidden_states + self.attn2(self.norm2(hidden_states), encoder_hidden_states=encoder_hidden_states)


class Denoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer_blocks = nn.ModuleList(BasicTransformerBlock() for _ in range(2))

    def forward(self, hidden_states, encoder_hidden_states):
        for block in self.transformer_blocks:
            hidden_states = block(hidden_states, encoder_hidden_states)
        return hidden_states


def main():
    torch.manual_seed(0)
    frames = torch.randn(2, 6, 16)  # six latent frames
    prompt = torch.randn(2, 6, 24)  # a prompt of six text states: as long as the frames
    with torch.no_grad():
        out = Denoiser().eval()(frames, prompt)
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
