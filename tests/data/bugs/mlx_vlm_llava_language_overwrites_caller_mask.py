"""mlx-vlm LLaVA language model overwrites the caller's attention mask with a fresh causal mask.

Citation: Blaizzy/mlx-vlm#1913 ("fix(models): honor a caller-supplied attention mask in five language
models", commit c070536e, 2026-08-16). Commit message: "Five model families declare a `mask` parameter,
forward it through the LanguageModel wrapper, and then overwrite it unconditionally with a freshly built
causal mask, so the caller's mask never reaches the layers. 41 sibling models guard the same call with
`if mask is None:`." The hunk in mlx_vlm/models/llava/language.py (class Llama):

    -        # if mask is None:
    -        mask = create_attention_mask(h, cache)
    +        if mask is None:
    +            mask = create_attention_mask(h, cache)

Bug: a caller that batches left-padded prompts builds a mask that is causal and hides each row's
padding, and passes it as `mask`; the LLaVA text model threw it away and used mlx-lm's
create_attention_mask, which for a multi-token step is the plain string "causal", so the padded
positions were attended. Fix: build the causal mask only when no mask was given.

Reproduction: a torch port of the LLaVA language model (LanguageModel -> Llama -> TransformerBlock ->
Attention, mlx-lm's create_attention_mask and scaled_dot_product_attention), called on a batch of two
left-padded prompts (3 and 6 tokens) with the padding-aware mask the caller built from attention_mask.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def create_causal_mask(N, offset=0, window_size=None, left_padding=None):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N)[:, None]
    mask = linds >= rinds[None]
    if window_size is not None:
        mask = mask & (linds < rinds[None] + window_size)
    if left_padding is not None:
        mask = mask & (left_padding[:, None, None, None] <= rinds)
    return mask


def create_attention_mask(h, cache=None, return_array=False):
    N = h.shape[1]
    if N == 1:
        return None
    offset = cache.offset if cache is not None else 0
    if return_array:
        return create_causal_mask(N, offset)
    return "causal"


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask):
    if isinstance(mask, str):
        assert mask == "causal"
        return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)


class ModelArgs:
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 4
    vocab_size = 64
    rms_norm_eps = 1e-6


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.head_dim = dim // self.n_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, mask=None, cache=None):
        B, L, D = x.shape
        q, k, v = (p(x).view(B, L, self.n_heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, D))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = nn.Sequential(nn.Linear(args.hidden_size, 64), nn.SiLU(), nn.Linear(64, args.hidden_size))
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.num_hidden_layers))
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def forward(self, inputs, mask=None, cache=None, inputs_embeds=None):
        h = self.embed_tokens(inputs) if inputs_embeds is None else inputs_embeds
        if cache is None:
            cache = [None] * len(self.layers)
        if FIXED:
            if mask is None:
                mask = create_attention_mask(h, cache[0])
        else:
            # if mask is None:
            mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


class LanguageModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.model = Llama(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, inputs, inputs_embeds=None, mask=None, cache=None):
        out = self.model(inputs, mask=mask, cache=cache, inputs_embeds=inputs_embeds)
        return self.lm_head(out)


def main():
    torch.manual_seed(0)
    language_model = LanguageModel(ModelArgs()).eval()
    pad_token_id = 0
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    L = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_token_id] * (L - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    # the caller's mask: causal and hiding each row's left padding
    left_padding = (attention_mask == 0).sum(-1)
    mask = create_causal_mask(L, 0, left_padding=left_padding)
    # a padded query row would see no key at all; let it see itself (its output is never used)
    mask = mask | torch.eye(L, dtype=torch.bool)
    with torch.no_grad():
        logits = language_model(input_ids, mask=mask)
    print("logits[0,-1,:3]", [round(v, 4) for v in logits[0, -1, :3].tolist()])


if __name__ == "__main__":
    main()
