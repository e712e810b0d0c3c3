# The Jamba bug (huggingface/transformers#32914: the Mamba mixer never handed the attention mask) written the way a
# Bamba / Mamba-2 hybrid writes its mixer: the causal conv runs over states the program pads on the left itself
# (F.pad, then F.conv1d with no padding), the attention layers use SDPA with a float mask whose fully masked padding
# rows are unmasked (Hugging Face's _unmask_unattended), and the prompts are left-padded with the EOS id, whose
# embedding is not zero. Bug: the mixer is called without the mask; fix: apply_mask_to_padding_states before in_proj.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(1)


class BambaConfig:
    vocab_size = 64
    hidden_size = 24
    num_attention_heads = 3
    mamba_d_conv = 4
    mamba_expand = 2
    mamba_d_state = 6
    layers_block_type = ["mamba", "attention", "mamba", "mamba"]
    pad_token_id = 2  # the EOS id


def apply_mask_to_padding_states(hidden_states, attention_mask):
    if attention_mask is not None and attention_mask.shape[1] > 1 and attention_mask.shape[0] > 1:
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    return hidden_states


class Mixer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        inner = cfg.mamba_expand * cfg.hidden_size
        self.d_conv, self.d_state = cfg.mamba_d_conv, cfg.mamba_d_state
        self.in_proj = nn.Linear(cfg.hidden_size, 2 * inner, bias=False)
        self.conv_weight = nn.Parameter(torch.randn(inner, 1, cfg.mamba_d_conv) * 0.5)
        self.conv_bias = nn.Parameter(torch.randn(inner) * 0.1)
        self.x_proj = nn.Linear(inner, 1 + 2 * cfg.mamba_d_state, bias=False)
        self.A_log = nn.Parameter(torch.zeros(inner))
        self.out_proj = nn.Linear(inner, cfg.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)
        x, z = self.in_proj(hidden_states).chunk(2, dim=-1)
        x = x.transpose(1, 2)  # (B, C, T)
        x = F.pad(x, (self.d_conv - 1, 0))  # causal: the zeros a conv state starts from
        x = F.silu(F.conv1d(x, self.conv_weight, self.conv_bias, groups=x.shape[1])).transpose(1, 2)
        x = apply_mask_to_padding_states(x, attention_mask)
        dt, B, C = torch.split(self.x_proj(x), [1, self.d_state, self.d_state], dim=-1)
        decay = torch.exp(-F.softplus(dt) * torch.exp(self.A_log))  # (B, T, inner)
        state = x.new_zeros(x.shape[0], x.shape[2], self.d_state)
        ys = []
        for t in range(x.shape[1]):
            state = decay[:, t, :, None] * state + x[:, t, :, None] * B[:, t, None, :]
            ys.append((state * C[:, t, None, :]).sum(-1))
        return self.out_proj(torch.stack(ys, 1) * F.silu(z))


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)
        self.o = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        b, t, d = hidden_states.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(hidden_states).chunk(3, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o(out.transpose(1, 2).reshape(b, t, d))


class Layer(nn.Module):
    def __init__(self, cfg, kind):
        super().__init__()
        self.kind = kind
        self.norm = nn.LayerNorm(cfg.hidden_size)
        self.mixer = Attention(cfg) if kind == "attention" else Mixer(cfg)

    def forward(self, hidden_states, causal_mask, attention_mask):
        h = self.norm(hidden_states)
        if self.kind == "attention":
            h = self.mixer(h, attention_mask=causal_mask)
        elif FIXED:
            h = self.mixer(h, attention_mask=attention_mask)
        else:
            h = self.mixer(h)
        return hidden_states + h


def float_causal_mask(attention_mask, dtype=torch.float32):
    """(B, 1, T, T) additive mask; rows that see nothing (left padding) unmasked, as _unmask_unattended does for SDPA."""
    t = attention_mask.shape[1]
    keep = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & attention_mask[:, None, None, :].bool()
    keep = keep | ~keep.any(-1, keepdim=True)
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


class BambaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, kind) for kind in cfg.layers_block_type)

    def forward(self, input_ids, attention_mask):
        h = self.embed_tokens(input_ids)
        causal_mask = float_causal_mask(attention_mask)
        for layer in self.layers:
            h = layer(h, causal_mask, attention_mask)
        return h


cfg = BambaConfig()
model = BambaModel(cfg).eval()
prompts = [[11, 7, 30, 41, 5, 9, 17], [20, 33, 8], [4, 12, 50, 6, 27]]
width = max(map(len, prompts))
input_ids = torch.tensor([[cfg.pad_token_id] * (width - len(p)) + p for p in prompts])
attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

with torch.no_grad():
    batched = model(input_ids, attention_mask)
    alone = model(torch.tensor([prompts[1]]), torch.ones(1, len(prompts[1]), dtype=torch.long))
diff = (batched[1, width - len(prompts[1]):] - alone[0]).abs().max().item()
print(f"max |batched - alone| on the real tokens of prompt 1: {diff:.3e}")
