"""muse-maskgit-pytorch: t5_encode_text zeroed the real tokens' embeddings, so cross-attention saw padding.

Citation: lucidrains/muse-maskgit-pytorch#38 ("T5 bug?"), acknowledged by the author ("yes, thank you") and
fixed in ``muse_maskgit_pytorch/t5.py`` (the stored copy, commit 0a8c49d, has the fixed line; I did not
identify the fixing commit). I read the issue, the fixed ``t5.py`` and ``MaskGitTransformer.forward``'s
``context_mask = (text_embeds != 0).any(dim = -1)``; the ``Attention`` class below follows the repository's
cross-attention (null key/value, masked_fill of ``~context_mask``) as I know it, not a line-by-line copy.

Bug: ``encoded_text = encoded_text.masked_fill(attn_mask[..., None], 0.)`` used the tokenizer's attention
mask (True at real tokens) as the fill mask, zeroing every real token's T5 embedding and keeping the
padding's. The transformer derives its cross-attention mask from the embeddings being non-zero, so image
tokens attended to the padding positions (plus the null key) and never to the prompt.

Fix: ``masked_fill(~attn_mask[..., None], 0.)``.

Reproduction: the pretrained T5 cannot be loaded here, so ``T5EncoderStandIn`` (embedding + layer norm,
random weights) stands for ``T5EncoderModel``'s last_hidden_state; ``t5_encode_text`` keeps the repository's
code after the model call. Two prompts of 5 and 2 tokens padded to the longest; 6 image tokens cross-attend.
"""
import sys

import torch
import torch.nn.functional as F
from torch import einsum, nn

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None


def l2norm(t):
    return F.normalize(t, dim=-1)


class T5EncoderStandIn(nn.Module):
    """Stands for the pretrained T5EncoderModel (random weights; no download)."""

    def __init__(self, vocab_size=32, d_model=16):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, input_ids, attention_mask):
        return self.norm(self.embed(input_ids))


def t5_encode_text(t5, input_ids, attn_mask):
    t5.eval()
    with torch.no_grad():
        encoded_text = t5(input_ids=input_ids, attention_mask=attn_mask).detach()

    attn_mask = attn_mask.bool()
    if FIXED:
        encoded_text = encoded_text.masked_fill(~attn_mask[..., None], 0.)
    else:
        encoded_text = encoded_text.masked_fill(attn_mask[..., None], 0.)
    return encoded_text


class Attention(nn.Module):
    def __init__(self, dim, dim_head=8, heads=2, cross_attend=False, scale=8):
        super().__init__()
        self.scale = scale
        self.heads = heads
        inner_dim = dim_head * heads
        self.cross_attend = cross_attend
        self.norm = nn.LayerNorm(dim)
        self.null_kv = nn.Parameter(torch.randn(2, heads, 1, dim_head))
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.q_scale = nn.Parameter(torch.ones(dim_head))
        self.k_scale = nn.Parameter(torch.ones(dim_head))
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, context=None, context_mask=None):
        assert not (exists(context) ^ self.cross_attend)
        b, h = x.shape[0], self.heads
        x = self.norm(x)
        kv_input = context if self.cross_attend else x
        q, k, v = (self.to_q(x), *self.to_kv(kv_input).chunk(2, dim=-1))
        q, k, v = (t.reshape(b, t.shape[1], h, -1).transpose(1, 2) for t in (q, k, v))
        nk, nv = self.null_kv
        nk, nv = (t[None].expand(b, -1, -1, -1) for t in (nk, nv))
        k = torch.cat((nk, k), dim=-2)
        v = torch.cat((nv, v), dim=-2)
        q, k = map(l2norm, (q, k))
        q = q * self.q_scale
        k = k * self.k_scale
        sim = einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        if exists(context_mask):
            context_mask = context_mask[:, None, None, :]
            context_mask = F.pad(context_mask, (1, 0), value=True)
            mask_value = -torch.finfo(sim.dtype).max
            sim = sim.masked_fill(~context_mask, mask_value)
        attn = sim.softmax(dim=-1)
        out = einsum("b h i j, b h j d -> b h i d", attn, v)
        out = out.transpose(1, 2).reshape(b, x.shape[1], -1)
        return self.to_out(out)


class MaskGitTransformer(nn.Module):
    def __init__(self, num_tokens=64, dim=16, seq_len=6, text_embed_dim=16):
        super().__init__()
        self.seq_len = seq_len
        self.token_emb = nn.Embedding(num_tokens + 1, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.text_embed_proj = nn.Linear(text_embed_dim, dim, bias=False)
        self.cross_attn = Attention(dim, cross_attend=True)
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)

    def forward(self, x, text_embeds):
        device, b, n = x.device, *x.shape
        assert n <= self.seq_len
        context = self.text_embed_proj(text_embeds)
        context_mask = (text_embeds != 0).any(dim=-1)
        x = self.token_emb(x)
        x = x + self.pos_emb(torch.arange(n, device=device))
        x = x + self.cross_attn(x, context=context, context_mask=context_mask)
        return self.to_logits(x)


def main():
    torch.manual_seed(0)
    t5 = T5EncoderStandIn()
    # tokenizer.batch_encode_plus(texts, padding='longest'): T5 pad id 0, eos id 1
    input_ids = torch.tensor([[7, 12, 5, 9, 1],
                              [22, 1, 0, 0, 0]])
    attn_mask = (torch.arange(5)[None, :] < torch.tensor([[5], [2]])).long()
    text_embeds = t5_encode_text(t5, input_ids, attn_mask)
    model = MaskGitTransformer().eval()
    image_token_ids = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        logits = model(image_token_ids, text_embeds=text_embeds)
    print("logits[:, 0, :3]:", [[round(v, 4) for v in row[0, :3].tolist()] for row in logits])


if __name__ == "__main__":
    main()
