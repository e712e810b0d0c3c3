"""unsloth-zoo MLX VLM training: the collated padding mask handed to mlx-vlm replaces causality.

Citation: unslothai/unsloth-zoo PR #963 "Fix MLX VLM training attention masking, shared
K/V, embedding scale and Gemma 3n batching" (merged; description read, diff not read).
Bug A of the PR: "A forwarded padding mask replaced causality. mlx-vlm treats a supplied
`mask` as the complete attention mask for every layer and only builds causal or sliding
masks when it is `None`. The baseline VLM loss forwarded the collated 2-D padding mask,
so causality was replaced outright and every supervised position could attend to the
token it was being scored on." (gemma-4-E2B loss 3.93 vs a transformers reference of
7.49; "Withholding the mask matches".)
Fix (as the PR states it): send `mask=None` except to the model families that genuinely
consume a padding mask, so the language model builds its own causal mask.

Reproduction: an MLX -> torch port of the relevant shape: mlx-vlm's language model
`__call__(inputs, inputs_embeds=None, mask=None, cache=None)` with
`if mask is None: mask = create_attention_mask(h, cache)` ("causal" for a multi-token
prompt), attention through a stand-in for `mx.fast.scaled_dot_product_attention`
(string "causal" -> is_causal, array -> broadcast mask), and unsloth-zoo's baseline loss
that collates one example padded to a bucket of 12 and forwards `mask=batch["attention_mask"]`.
The (1, L) padding mask broadcasts as a key-padding-only mask. Names of the unsloth-zoo
loss function are reconstructed; the mlx-vlm branch is as the PR describes it.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def fast_scaled_dot_product_attention(q, k, v, scale, mask=None):
    """Stand-in for mx.fast.scaled_dot_product_attention's mask handling."""
    if isinstance(mask, str):
        assert mask == "causal"
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.bool()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def create_attention_mask(h, cache=None):
    T = h.shape[1]
    if T > 1:
        return "causal"
    return None


class Attention(nn.Module):
    def __init__(self, dims, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dims // n_heads
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(dims, dims, bias=False)
        self.k_proj = nn.Linear(dims, dims, bias=False)
        self.v_proj = nn.Linear(dims, dims, bias=False)
        self.o_proj = nn.Linear(dims, dims, bias=False)

    def __call__(self, x, mask=None, cache=None):
        B, L, D = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        out = fast_scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, D))


class TransformerBlock(nn.Module):
    def __init__(self, dims, n_heads):
        super().__init__()
        self.self_attn = Attention(dims, n_heads)
        self.input_layernorm = nn.RMSNorm(dims)
        self.post_attention_layernorm = nn.RMSNorm(dims)
        self.mlp = nn.Sequential(nn.Linear(dims, 2 * dims), nn.GELU(), nn.Linear(2 * dims, dims))

    def __call__(self, x, mask=None, cache=None):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LanguageModel(nn.Module):
    def __init__(self, vocab_size=40, dims=32, n_heads=4, n_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, dims)
        self.layers = nn.ModuleList([TransformerBlock(dims, n_heads) for _ in range(n_layers)])
        self.norm = nn.RMSNorm(dims)
        self.lm_head = nn.Linear(dims, vocab_size, bias=False)

    def __call__(self, inputs, inputs_embeds=None, mask=None, cache=None):
        h = self.embed_tokens(inputs) if inputs_embeds is None else inputs_embeds
        if mask is None:
            mask = create_attention_mask(h, cache)
        for layer in self.layers:
            h = layer(h, mask)
        return self.lm_head(self.norm(h))


def baseline_vlm_loss(model, batch):
    """Next-token loss over the supervised positions of a collated batch."""
    input_ids = batch["input_ids"]
    mask = None if FIXED else batch["attention_mask"]
    logits = model(input_ids[:, :-1], mask=mask if mask is None else mask[:, :-1])
    targets = input_ids[:, 1:]
    weights = batch["attention_mask"][:, 1:].float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return (ce * weights.reshape(-1)).sum() / weights.sum()


def main():
    torch.manual_seed(0)
    model = LanguageModel().eval()
    tokens = [3, 17, 9, 22, 5, 31, 12, 8, 27]
    bucket = 12  # padded up to the bucket length
    input_ids = torch.tensor([tokens + [0] * (bucket - len(tokens))])
    attention_mask = torch.tensor([[1] * len(tokens) + [0] * (bucket - len(tokens))])
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    with torch.no_grad():
        loss = baseline_vlm_loss(model, batch)
    print("fixed" if FIXED else "buggy", "loss:", f"{loss.item():.4f}")


if __name__ == "__main__":
    main()
