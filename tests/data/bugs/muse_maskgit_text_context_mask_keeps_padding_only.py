# lucidrains/muse-maskgit-pytorch commit 83aea2d ("end-to-end for base maskgit training for starters"),
# muse_pytorch/muse_pytorch.py, Transformer.forward.
# The cross-attention mask over the T5 text embeddings (padding rows zeroed by t5_encode_text) was built as
# `context_mask = torch.any(text_embeds == 0, dim = -1)`: True only on the zeroed padding rows, so the image
# tokens cross-attended the padding (and the null key) while every real caption token was masked out.
# The fix builds it as `(text_embeds != 0).any(dim = -1)`, True on the real caption tokens.
# einops' rearrange / repeat are written out with view / expand (einops is not installed here).
import math
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn, einsum
from transformers import T5Config, T5EncoderModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


# t5 stand-in: a tiny T5 encoder built from its config, encoding already-tokenized captions as t5.py does

T5_CONFIG = T5Config(vocab_size=64, d_model=48, d_kv=12, d_ff=64, num_layers=1, num_heads=4, pad_token_id=0)
_T5 = T5EncoderModel(T5_CONFIG).eval()


def get_encoded_dim(name):
    return T5_CONFIG.d_model


def t5_encode_text(encoded, name=None, output_device=None):
    input_ids = encoded["input_ids"]
    attn_mask = encoded["attention_mask"]

    with torch.no_grad():
        output = _T5(input_ids=input_ids, attention_mask=attn_mask)
        encoded_text = output.last_hidden_state.detach()

    attn_mask = attn_mask.bool()
    encoded_text = encoded_text.masked_fill(~attn_mask[..., None], 0.)
    return encoded_text


# classes

class LayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.register_buffer('beta', torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.gamma, self.beta)


class GEGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return gate * F.gelu(x)


def FeedForward(dim, mult=4):
    inner_dim = int(dim * mult * 2 / 3)
    return nn.Sequential(
        LayerNorm(dim),
        nn.Linear(dim, inner_dim * 2, bias=False),
        GEGLU(),
        LayerNorm(inner_dim),
        nn.Linear(inner_dim, dim, bias=False)
    )


class Attention(nn.Module):
    def __init__(self, dim, dim_head=64, heads=8, cross_attend=False):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        inner_dim = dim_head * heads

        self.cross_attend = cross_attend
        self.norm = LayerNorm(dim)

        self.null_kv = nn.Parameter(torch.randn(2, heads, 1, dim_head))

        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, context=None, context_mask=None):
        assert not (exists(context) ^ self.cross_attend)

        h, is_cross_attn = self.heads, exists(context)

        x = self.norm(x)

        kv_input = context if self.cross_attend else x

        q, k, v = (self.to_q(x), *self.to_kv(kv_input).chunk(2, dim=-1))

        q = q * self.scale

        # rearrange(t, 'b n (h d) -> b h n d', h = h)
        q, k, v = map(lambda t: t.view(t.shape[0], t.shape[1], h, -1).transpose(1, 2), (q, k, v))

        nk, nv = self.null_kv
        # repeat(t, 'h 1 d -> b h 1 d', b = x.shape[0])
        nk, nv = map(lambda t: t.unsqueeze(0).expand(x.shape[0], -1, -1, -1), (nk, nv))

        k = torch.cat((nk, k), dim=-2)
        v = torch.cat((nv, v), dim=-2)

        sim = einsum('b h i d, b h j d -> b h i j', q, k)

        if exists(context_mask):
            context_mask = context_mask[:, None, None, :]  # rearrange(context_mask, 'b j -> b 1 1 j')
            context_mask = F.pad(context_mask, (1, 0), value=True)

            mask_value = -torch.finfo(sim.dtype).max
            sim = sim.masked_fill(~context_mask, mask_value)

        attn = sim.softmax(dim=-1)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)

        out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)  # 'b h n d -> b n (h d)'
        return self.to_out(out)


class TransformerBlocks(nn.Module):
    def __init__(self, *, dim, depth, dim_head=64, heads=8, ff_mult=4):
        super().__init__()
        self.layers = nn.ModuleList([])

        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                Attention(dim=dim, dim_head=dim_head, heads=heads),
                Attention(dim=dim, dim_head=dim_head, heads=heads, cross_attend=True),
                FeedForward(dim=dim, mult=ff_mult)
            ]))

        self.norm = LayerNorm(dim)

    def forward(self, x, context=None, context_mask=None):
        for attn, cross_attn, ff in self.layers:
            x = attn(x) + x

            x = cross_attn(x, context=context, context_mask=context_mask) + x

            x = ff(x) + x

        return self.norm(x)


def uniform(shape, min=0, max=1, device=None):
    return torch.zeros(shape, device=device).float().uniform_(0, 1)


def prob_mask_like(shape, prob, device=None):
    if prob == 1:
        return torch.ones(shape, device=device, dtype=torch.bool)
    elif prob == 0:
        return torch.zeros(shape, device=device, dtype=torch.bool)
    else:
        return uniform(shape, device=device) < prob


class Transformer(nn.Module):
    def __init__(self, *, num_tokens, dim, seq_len, t5_name='t5-small', **kwargs):
        super().__init__()
        self.mask_id = num_tokens

        self.token_emb = nn.Embedding(num_tokens + 1, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.seq_len = seq_len

        self.transformer_blocks = TransformerBlocks(dim=dim, **kwargs)
        self.norm = LayerNorm(dim)

        self.to_logits = nn.Linear(dim, num_tokens, bias=False)

        # text conditioning

        self.encode_text = partial(t5_encode_text, name=t5_name)

        text_embed_dim = get_encoded_dim(t5_name)

        self.text_embed_proj = nn.Linear(text_embed_dim, dim, bias=False) if text_embed_dim != dim else nn.Identity()

    def forward(
        self,
        x,
        return_embed=False,
        labels=None,
        ignore_index=0,
        cond_drop_prob=0.,
        conditioning_token_ids=None,
        texts=None,
        text_embeds=None
    ):
        device, b, n = x.device, *x.shape
        assert n <= self.seq_len

        # prepare texts

        assert exists(texts) ^ exists(text_embeds)

        if exists(texts):
            text_embeds = self.encode_text(texts)

        context = self.text_embed_proj(text_embeds)

        if FIXED:
            context_mask = (text_embeds != 0).any(dim=-1)
        else:
            context_mask = torch.any(text_embeds == 0, dim=-1)

        # classifier free guidance

        if self.training and cond_drop_prob > 0.:
            mask = prob_mask_like((b, 1), 1. - cond_drop_prob, device)
            context_mask = context_mask & mask

        # concat conditioning image token ids if needed

        if exists(conditioning_token_ids):
            cond_token_emb = self.token_emb(conditioning_token_ids)
            context = torch.cat((context, cond_token_emb), dim=-2)
            context_mask = F.pad(context_mask, (0, conditioning_token_ids.shape[-1]), value=True)

        # embed tokens

        x = self.token_emb(x)
        x = x + self.pos_emb(torch.arange(n, device=device))

        x = self.transformer_blocks(x, context=context, context_mask=context_mask)

        if return_embed:
            return x

        logits = self.to_logits(x)

        if not exists(labels):
            return logits

        logits = logits.transpose(1, 2)  # rearrange(logits, 'b n c -> b c n')
        return F.cross_entropy(logits, labels, ignore_index=ignore_index)


def cosine_schedule(t):
    return torch.cos(t * math.pi * 0.5)


def main():
    num_tokens, seq_len = 32, 16  # a 4x4 grid of VQ codes
    transformer = Transformer(num_tokens=num_tokens, dim=32, seq_len=seq_len, depth=2, dim_head=8, heads=4, ff_mult=2)

    # two captions, already tokenized, right-padded with T5's pad id 0
    texts = {
        "input_ids": torch.tensor([[12, 7, 33, 9, 1, 0, 0, 0], [5, 41, 1, 0, 0, 0, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]),
    }

    # maskgit training step: mask a cosine-scheduled fraction of the image tokens, predict them
    ids = torch.randint(0, num_tokens, (2, seq_len))
    rand_time = torch.tensor([0.3, 0.6])
    num_token_masked = (seq_len * cosine_schedule(rand_time)).round().clamp(min=1)
    batch_randperm = torch.rand((2, seq_len)).argsort(dim=-1)
    mask = batch_randperm < num_token_masked[:, None]
    ignore_index = -1
    x = torch.where(mask, transformer.mask_id, ids)
    labels = torch.where(mask, ids, ignore_index)

    transformer.train()
    loss = transformer(x, texts=texts, labels=labels, ignore_index=ignore_index, cond_drop_prob=0.)
    loss.backward()

    transformer.eval()
    with torch.no_grad():
        logits = transformer(x, texts=texts)
    print(f"loss {loss.item():.6f}")
    print(f"text_embed_proj grad norm {transformer.text_embed_proj.weight.grad.norm().item():.6f}")
    print(f"predicted codes at masked slots, sample 0: {logits[0].argmax(-1)[mask[0]].tolist()}")
    print(f"logits[0, 0, :4] {logits[0, 0, :4].tolist()}")


if __name__ == "__main__":
    main()
