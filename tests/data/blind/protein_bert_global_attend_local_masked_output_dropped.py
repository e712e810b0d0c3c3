# lucidrains/protein-bert-pytorch commit e5a073c ("fix bug"), protein_bert_pytorch/protein_bert_pytorch.py.
#
# ProteinBERT runs two tracks per layer: a local track over the residues of a right-padded batch of
# proteins (convolutions, with the padding zeroed by `mask`) and a global track over the annotation
# vector (GO terms) projected to `num_global_tokens` tokens.  The global track reads the residues by
# cross-attention, `self.global_attend_local(annotation, tokens, context_mask = mask)`: a
# CrossAttention whose keys are the residues plus a learned null key, with the padding mask
# (F.pad with True for the null key) turned into a (b, 1, i, j) mask and filled with -max before the
# softmax.  Before the fix the result was assigned to `local_info` and never used, so the masked
# attention over the residues had no effect: the annotation logits did not depend on the sequence at
# all and the global track went on from the unattended annotation.  The fix assigns the masked
# cross-attention's output to `annotation`.
#
# Ported from protein_bert_pytorch/protein_bert_pytorch.py at e5a073c^ / e5a073c (CrossAttention,
# Layer, ProteinBERT; GlobalLinearSelfAttention is off by default, local_self_attn = False, and is left
# out); the einops rearrange / repeat / Reduce calls are written with torch ops.
import sys

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)

# helpers


def exists(val):
    return val is not None


def max_neg_value(t):
    return -torch.finfo(t.dtype).max


def split_heads(t, h):
    # rearrange(t, 'b n (h d) -> b h n d', h = h)
    b, n, hd = t.shape
    return t.reshape(b, n, h, hd // h).permute(0, 2, 1, 3)


def merge_heads(t):
    # rearrange(out, 'b h n d -> b n (h d)')
    b, h, n, d = t.shape
    return t.permute(0, 2, 1, 3).reshape(b, n, h * d)

# helper classes


class Residual(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x) + x


class MeanTokens(nn.Module):
    # Reduce('b n d -> b d', 'mean')
    def forward(self, x):
        return x.mean(dim=1)


class CrossAttention(nn.Module):
    def __init__(
        self,
        *,
        dim,
        dim_keys,
        dim_out,
        heads,
        dim_head=64,
        qk_activation=nn.Tanh()
    ):
        super().__init__()
        self.heads = heads
        self.scale = dim_head ** -0.5
        inner_dim = dim_head * heads

        self.qk_activation = qk_activation

        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim_keys, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim_out)

        self.null_key = nn.Parameter(torch.randn(dim_head))
        self.null_value = nn.Parameter(torch.randn(dim_head))

    def forward(self, x, context, mask=None, context_mask=None):
        b, h, device = x.shape[0], self.heads, x.device

        q = self.to_q(x)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        q, k, v = map(lambda t: split_heads(t, h), (q, k, v))

        # repeat(t, 'd -> b h () d', b = b, h = h)
        null_k, null_v = map(lambda t: t.view(1, 1, 1, -1).expand(b, h, 1, -1), (self.null_key, self.null_value))
        k = torch.cat((null_k, k), dim=-2)
        v = torch.cat((null_v, v), dim=-2)

        q, k = map(lambda t: self.qk_activation(t), (q, k))

        sim = einsum('b h i d, b h j d -> b h i j', q, k) * self.scale

        if exists(mask) or exists(context_mask):
            i, j = sim.shape[-2:]

            if not exists(mask):
                mask = torch.ones(b, i, dtype=torch.bool, device=device)

            if exists(context_mask):
                context_mask = F.pad(context_mask, (1, 0), value=True)
            else:
                context_mask = torch.ones(b, j, dtype=torch.bool, device=device)

            # rearrange(mask, 'b i -> b () i ()') * rearrange(context_mask, 'b j -> b () () j')
            mask = mask[:, None, :, None] * context_mask[:, None, None, :]
            sim.masked_fill_(~mask, max_neg_value(sim))

        attn = sim.softmax(dim=-1)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        out = merge_heads(out)
        return self.to_out(out)


class Layer(nn.Module):
    def __init__(
        self,
        *,
        dim,
        dim_global,
        narrow_conv_kernel=9,
        wide_conv_kernel=9,
        wide_conv_dilation=5,
        attn_heads=8,
        attn_dim_head=64,
        attn_qk_activation=nn.Tanh(),
        local_to_global_attn=False,
        glu_conv=False
    ):
        super().__init__()

        conv_mult = 2 if glu_conv else 1

        self.narrow_conv = nn.Sequential(
            nn.Conv1d(dim, dim * conv_mult, narrow_conv_kernel, padding=narrow_conv_kernel // 2),
            nn.GELU() if not glu_conv else nn.GLU(dim=1)
        )

        wide_conv_padding = (wide_conv_kernel + (wide_conv_kernel - 1) * (wide_conv_dilation - 1)) // 2

        self.wide_conv = nn.Sequential(
            nn.Conv1d(dim, dim * conv_mult, wide_conv_kernel, dilation=wide_conv_dilation, padding=wide_conv_padding),
            nn.GELU() if not glu_conv else nn.GLU(dim=1)
        )

        self.local_to_global_attn = local_to_global_attn

        if local_to_global_attn:
            self.extract_global_info = CrossAttention(
                dim=dim,
                dim_keys=dim_global,
                dim_out=dim,
                heads=attn_heads,
                dim_head=attn_dim_head
            )
        else:
            self.extract_global_info = nn.Sequential(
                MeanTokens(),
                nn.Linear(dim_global, dim),
                nn.GELU(),
            )

        self.local_norm = nn.LayerNorm(dim)

        self.local_feedforward = nn.Sequential(
            Residual(nn.Sequential(
                nn.Linear(dim, dim),
                nn.GELU(),
            )),
            nn.LayerNorm(dim)
        )

        self.global_attend_local = CrossAttention(dim=dim_global, dim_out=dim_global, dim_keys=dim, heads=attn_heads, dim_head=attn_dim_head, qk_activation=attn_qk_activation)

        self.global_dense = nn.Sequential(
            nn.Linear(dim_global, dim_global),
            nn.GELU()
        )

        self.global_norm = nn.LayerNorm(dim_global)

        self.global_feedforward = nn.Sequential(
            Residual(nn.Sequential(
                nn.Linear(dim_global, dim_global),
                nn.GELU()
            )),
            nn.LayerNorm(dim_global),
        )

    def forward(self, tokens, annotation, mask=None):
        if self.local_to_global_attn:
            global_info = self.extract_global_info(tokens, annotation, mask=mask)
        else:
            global_info = self.extract_global_info(annotation).unsqueeze(1)  # Rearrange('b d -> b () d')

        # process local (protein sequence)

        global_linear_attn = 0  # local_self_attn = False

        conv_input = tokens.transpose(1, 2)  # rearrange(tokens, 'b n d -> b d n')

        if exists(mask):
            conv_input_mask = mask.unsqueeze(1)  # rearrange(mask, 'b n -> b () n')
            conv_input = conv_input.masked_fill(~conv_input_mask, 0.)

        narrow_out = self.narrow_conv(conv_input)
        narrow_out = narrow_out.transpose(1, 2)
        wide_out = self.wide_conv(conv_input)
        wide_out = wide_out.transpose(1, 2)

        tokens = tokens + narrow_out + wide_out + global_info + global_linear_attn
        tokens = self.local_norm(tokens)

        tokens = self.local_feedforward(tokens)

        # process global (annotations)

        if FIXED:
            annotation = self.global_attend_local(annotation, tokens, context_mask=mask)
        else:
            local_info = self.global_attend_local(annotation, tokens, context_mask=mask)
        annotation = self.global_dense(annotation)
        annotation = self.global_norm(annotation)
        annotation = self.global_feedforward(annotation)

        return tokens, annotation

# main model


class ProteinBERT(nn.Module):
    def __init__(
        self,
        *,
        num_tokens=26,
        num_annotation=8943,
        dim=512,
        dim_global=256,
        depth=6,
        narrow_conv_kernel=9,
        wide_conv_kernel=9,
        wide_conv_dilation=5,
        attn_heads=8,
        attn_dim_head=64,
        attn_qk_activation=nn.Tanh(),
        local_to_global_attn=False,
        num_global_tokens=1,
        glu_conv=False
    ):
        super().__init__()
        self.num_tokens = num_tokens
        self.token_emb = nn.Embedding(num_tokens, dim)

        self.num_global_tokens = num_global_tokens
        self.to_global_emb = nn.Linear(num_annotation, num_global_tokens * dim_global)

        self.layers = nn.ModuleList([Layer(dim=dim, dim_global=dim_global, narrow_conv_kernel=narrow_conv_kernel, wide_conv_dilation=wide_conv_dilation, wide_conv_kernel=wide_conv_kernel, attn_qk_activation=attn_qk_activation, local_to_global_attn=local_to_global_attn, glu_conv=glu_conv) for layer in range(depth)])

        self.to_token_logits = nn.Linear(dim, num_tokens)

        self.to_annotation_logits = nn.Sequential(
            MeanTokens(),
            nn.Linear(dim_global, num_annotation)
        )

    def forward(self, seq, annotation, mask=None):
        tokens = self.token_emb(seq)

        annotation = self.to_global_emb(annotation)
        annotation = annotation.reshape(annotation.shape[0], self.num_global_tokens, -1)  # 'b (n d) -> b n d'

        for layer in self.layers:
            tokens, annotation = layer(tokens, annotation, mask=mask)

        tokens = self.to_token_logits(tokens)
        annotation = self.to_annotation_logits(annotation)
        return tokens, annotation


# ---- a right-padded batch of two proteins: 0 = padding, 1 = start, 2 = end, 3.. = amino acids ----

AA = "ACDEFGHIKLMNPQRSTVWY"


def encode(protein):
    return [1] + [3 + AA.index(a) for a in protein] + [2]


proteins = ["MKTAYIAKQRQISFVKSHFSRQ", "GSHMLEDPV"]
ids = [encode(p) for p in proteins]
max_len = max(len(x) for x in ids)
seq = torch.tensor([x + [0] * (max_len - len(x)) for x in ids])
mask = seq != 0

num_annotation = 64
annotation = torch.zeros(2, num_annotation)
annotation[0, [3, 17, 40]] = 1.
annotation[1, [5, 17]] = 1.

model = ProteinBERT(
    num_tokens=23,
    num_annotation=num_annotation,
    dim=32,
    dim_global=16,
    depth=2,
    narrow_conv_kernel=9,
    wide_conv_kernel=9,
    wide_conv_dilation=5,
    attn_heads=2,
    attn_dim_head=8,
    num_global_tokens=2,
)
model.eval()

with torch.no_grad():
    seq_logits, annotation_logits = model(seq, annotation, mask=mask)

print("mask:", mask.int().tolist())
print("annotation logits, protein 2 (first 6):", [round(v, 4) for v in annotation_logits[1, :6].tolist()])
print("annotation BCE:", round(F.binary_cross_entropy_with_logits(annotation_logits, annotation, reduction='sum').item(), 4))
print("residue logits argmax, protein 2:", seq_logits[1][mask[1]].argmax(-1).tolist())
