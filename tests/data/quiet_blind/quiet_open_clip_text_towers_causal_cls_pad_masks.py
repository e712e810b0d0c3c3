"""open_clip text towers (CLIP causal + argmax EOT pooling, CoCa appended CLS with
causal + pad additive mask, bidirectional pad-masked tower with EOS pooling).

Port of mlfoundations/open_clip @89fb801f1e6087880e951fc8354b8a2077b79c6d
src/open_clip/transformer.py: Attention.forward, ResidualAttentionBlock,
TextTransformer.build_causal_mask / _build_additive_mask / _embeds / forward,
text_global_pool.  Tiny sizes, CPU.  Checked against every caption run alone,
unpadded, with a per-query loop over the keys it may see.
"""
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, dim, num_heads=8):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.in_proj_weight = nn.Parameter(torch.empty((dim * 3, dim)))
        self.in_proj_bias = nn.Parameter(torch.empty(dim * 3))
        self.out_proj = nn.Linear(dim, dim)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.normal_(self.in_proj_bias, std=0.02)

    def forward(self, x, attn_mask=None):
        N, L, C = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        q = q.reshape(N, -1, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(N, -1, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(N, -1, self.num_heads, self.head_dim).transpose(1, 2)
        if attn_mask is not None and attn_mask.ndim == 3:
            # reshape (N*num_heads, L, L) -> (N, num_heads, L, L)
            attn_mask = attn_mask.reshape(N, self.num_heads, L, L)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scale)
        x = x.transpose(1, 2).reshape(N, -1, C)
        return self.out_proj(x)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, d_model, n_head, mlp_ratio=4.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, num_heads=n_head)
        self.ln_2 = nn.LayerNorm(d_model)
        w = int(d_model * mlp_ratio)
        self.mlp = nn.Sequential(OrderedDict([
            ("c_fc", nn.Linear(d_model, w)), ("gelu", nn.GELU()), ("c_proj", nn.Linear(w, d_model))]))

    def forward(self, x, attn_mask=None):
        attn_mask = attn_mask.to(x.dtype) if attn_mask is not None else None
        x = x + self.attn(self.ln_1(x), attn_mask=attn_mask)
        return x + self.mlp(self.ln_2(x))


def text_global_pool(x, text=None, pool_type='argmax', eos_token_id=None):
    if pool_type == 'first':
        return x[:, 0]
    if pool_type == 'last':
        return x[:, -1]
    if pool_type == 'argmax':
        # eot_token is the highest number in each sequence
        return x[torch.arange(x.shape[0]), text.argmax(dim=-1)]
    if pool_type == 'eos':
        idx = (text == eos_token_id).int().argmax(dim=-1)
        return x[torch.arange(x.shape[0]), idx]
    return x


class TextTransformer(nn.Module):
    def __init__(self, context_length=10, vocab_size=50, width=32, heads=4, layers=2, output_dim=16,
                 embed_cls=False, no_causal_mask=False, use_pad_mask=False, correct_cls_mask=False,
                 pad_id=0, eos_id=2, pool_type='argmax'):
        super().__init__()
        self.num_pos = self.context_length = context_length
        self.heads = heads
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.pool_type = pool_type
        self.use_pad_mask = use_pad_mask and no_causal_mask  # only use in bi-dir mode
        self.correct_cls_mask = correct_cls_mask
        self.token_embedding = nn.Embedding(vocab_size, width)
        nn.init.normal_(self.token_embedding.weight, std=0.5)
        if embed_cls:
            self.cls_emb = nn.Parameter(torch.randn(width) * 0.5)
            self.num_pos += 1
        else:
            self.cls_emb = None
        self.positional_embedding = nn.Parameter(torch.randn(self.num_pos, width) * 0.3)
        self.resblocks = nn.ModuleList([ResidualAttentionBlock(width, heads) for _ in range(layers)])
        self.ln_final = nn.LayerNorm(width)
        if no_causal_mask:
            self.attn_mask = None
        else:
            self.register_buffer('attn_mask', self.build_causal_mask(), persistent=False)
        self.text_projection = nn.Parameter(torch.randn(width, output_dim) * width ** -0.5)

    def build_causal_mask(self):
        # pytorch uses additive attention mask; fill with -inf
        mask = torch.empty(self.num_pos, self.num_pos)
        mask.fill_(float("-inf"))
        mask.triu_(1)  # zero out the lower diagonal
        return mask

    def _build_additive_mask(self, text, seq_len, dtype):
        valid = text != self.pad_id  # [B, L] (True = keep)
        if self.cls_emb is not None:
            cls_valid = valid.new_ones(valid.size(0), 1)
            valid = torch.cat([valid, cls_valid] if self.correct_cls_mask else [cls_valid, valid], 1)
        key_mask = valid.unsqueeze(1).expand(-1, seq_len, -1)  # [B, Q, K]
        additive = torch.zeros_like(key_mask, dtype=dtype)
        additive.masked_fill_(~key_mask, float("-inf"))
        return additive.repeat_interleave(self.heads, 0)  # [B*H, Q, K]

    def _embeds(self, text):
        B, seq_len = text.shape
        x = self.token_embedding(text)
        if self.cls_emb is not None:
            x = torch.cat([x, self.cls_emb.view(1, 1, -1).expand(B, -1, -1)], 1)
            seq_len += 1
        attn_mask = self.attn_mask
        if attn_mask is not None:
            attn_mask = attn_mask[:seq_len, :seq_len]
        if self.use_pad_mask or self.cls_emb is not None:
            add_mask = self._build_additive_mask(text, seq_len, x.dtype)
            attn_mask = attn_mask.unsqueeze(0) + add_mask if attn_mask is not None else add_mask
        x = x + self.positional_embedding[:seq_len]
        return x, attn_mask

    def forward(self, text):
        x, attn_mask = self._embeds(text)
        for r in self.resblocks:
            x = r(x, attn_mask=attn_mask)
        if self.cls_emb is not None:
            pooled = self.ln_final(text_global_pool(x, pool_type='last'))
            tokens = x[:, :-1]
        else:
            x = self.ln_final(x)
            pooled = text_global_pool(x, text, pool_type=self.pool_type, eos_token_id=self.eos_id)
            tokens = x
        return pooled @ self.text_projection, tokens


# ---------------- independent reference: one caption, no padding, loop over queries
def ref_block(blk, x, allowed):
    """x: (T, C); allowed(i) -> list of key indices query i may see."""
    a = blk.attn
    h = blk.ln_1(x)
    q, k, v = F.linear(h, a.in_proj_weight, a.in_proj_bias).chunk(3, dim=-1)
    T, C = x.shape
    out = torch.zeros(T, C)
    for i in range(T):
        keys = allowed(i)
        heads = []
        for hh in range(a.num_heads):
            sl = slice(hh * a.head_dim, (hh + 1) * a.head_dim)
            s = (k[keys, sl] @ q[i, sl]) * a.scale
            heads.append(torch.softmax(s, 0) @ v[keys, sl])
        out[i] = torch.cat(heads)
    x = x + a.out_proj(out)
    return x + blk.mlp(blk.ln_2(x))


def ref_tower(m, ids, mode):
    """ids: the caption's real tokens only (ends with EOT / EOS)."""
    n = len(ids)
    x = m.token_embedding(torch.tensor(ids))
    pos = m.positional_embedding[:n]
    if mode == 'coca':
        # CLS always sits after the padded context (position L) in the batch run
        x = torch.cat([x, m.cls_emb[None]], 0)
        pos = torch.cat([pos, m.positional_embedding[m.context_length:m.context_length + 1]], 0)
    x = x + pos
    T = x.shape[0]
    if mode == 'bidir':
        allowed = lambda i: list(range(T))
    else:
        allowed = lambda i: list(range(i + 1))
    for blk in m.resblocks:
        x = ref_block(blk, x, allowed)
    if mode == 'coca':
        return m.ln_final(x[-1]) @ m.text_projection, x[:-1]
    x = m.ln_final(x)
    if mode == 'clip':
        pooled = x[-1]  # EOT is the last real token
    else:
        pooled = x[ids.index(m.eos_id)]
    return pooled @ m.text_projection, x


L = 10
EOT = 49
captions = [[1, 5, 9, 33, 7, 12, 4, 18, 21, EOT], [1, 7, 3, EOT], [1, 40, 11, 6, 25, EOT]]


def pad(caps):
    t = torch.zeros(len(caps), L, dtype=torch.long)  # pad_id 0, right padding
    for b, c in enumerate(caps):
        t[b, :len(c)] = torch.tensor(c)
    return t


ok_all = True
with torch.no_grad():
    # 1) CLIP text tower: causal -inf buffer, no pad mask, argmax (EOT) pooling
    clip = TextTransformer(context_length=L).eval()
    pooled, tokens = clip(pad(captions))
    for b, c in enumerate(captions):
        rp, rt = ref_tower(clip, c, 'clip')
        ok = torch.allclose(pooled[b], rp, atol=1e-5) and torch.allclose(tokens[b, :len(c)], rt, atol=1e-5)
        print(f"clip causal argmax caption {b}: match={ok}")
        ok_all &= ok

    # 2) CoCa unimodal text tower: appended CLS, causal + pad additive mask (correct_cls_mask)
    coca = TextTransformer(context_length=L, embed_cls=True, correct_cls_mask=True, pad_id=0).eval()
    pooled, tokens = coca(pad(captions))
    for b, c in enumerate(captions):
        rp, rt = ref_tower(coca, c, 'coca')
        ok = torch.allclose(pooled[b], rp, atol=1e-5) and torch.allclose(tokens[b, :len(c)], rt, atol=1e-5)
        print(f"coca cls causal+pad caption {b}: match={ok}")
        ok_all &= ok

    # 3) bidirectional tower with pad mask and EOS pooling (no_causal_mask + use_pad_mask)
    EOS = 2
    caps_eos = [c[:-1] + [EOS] for c in captions]
    bid = TextTransformer(context_length=L, no_causal_mask=True, use_pad_mask=True, pad_id=0,
                          eos_id=EOS, pool_type='eos').eval()
    pooled, tokens = bid(pad(caps_eos))
    for b, c in enumerate(caps_eos):
        rp, rt = ref_tower(bid, c, 'bidir')
        ok = torch.allclose(pooled[b], rp, atol=1e-5) and torch.allclose(tokens[b, :len(c)], rt, atol=1e-5)
        print(f"bidir pad-masked eos caption {b}: match={ok}")
        ok_all &= ok

    # zero-shot style logits with a fixed image embedding batch
    img = F.normalize(torch.randn(2, 16), dim=-1)
    txt = F.normalize(clip(pad(captions))[0], dim=-1)
    logits = 100.0 * img @ txt.T
    print("logits shape", tuple(logits.shape), "finite", bool(torch.isfinite(logits).all()))

print("ALL MATCH" if ok_all else "MISMATCH")
assert ok_all
