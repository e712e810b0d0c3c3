# samvanstroud/hepattn d3ff48f (PR #19): the MaskFormer over detector hits built its masked-attention mask with the
# Mask2Former convention (True = blocked: sigmoid < threshold) but fed it to F.scaled_dot_product_attention, where
# True = attend, so each object query attended to exactly the hits it predicted it did NOT own.
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, dim, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.attn = F.scaled_dot_product_attention

    def separate_heads(self, x, num_heads):
        b, s, d = x.shape
        return x.view(b, s, num_heads, d // num_heads).transpose(1, 2)

    def recombine_heads(self, x):
        b, h, s, d = x.shape
        return x.transpose(1, 2).reshape(b, s, h * d)

    def forward(self, q, k=None, v=None, attn_mask=None):
        k = k if k is not None else q
        v = v if v is not None else q
        q = self.separate_heads(self.q_proj(q), self.num_heads)
        k = self.separate_heads(self.k_proj(k), self.num_heads)
        v = self.separate_heads(self.v_proj(v), self.num_heads)
        # Have to expand the attention mask so that it is broadcasted over the head dimension
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(-3)
        out = self.attn(q, k, v, attn_mask=attn_mask)
        return self.out_proj(self.recombine_heads(out))


class Dense(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        return self.net(x)


class Residual(nn.Module):
    def __init__(self, fn, dim, norm=nn.LayerNorm):
        super().__init__()
        self.fn = fn
        self.norm = norm(dim)

    def forward(self, x, **kwargs):
        return x + self.fn(self.norm(x), **kwargs)


class MaskFormerDecoderLayer(nn.Module):
    def __init__(self, dim, mask_attention=True, bidirectional_ca=True):
        super().__init__()
        self.mask_attention = mask_attention
        self.bidirectional_ca = bidirectional_ca
        residual = partial(Residual, dim=dim)
        self.q_ca = residual(Attention(dim))
        self.q_sa = residual(Attention(dim))
        self.q_dense = residual(Dense(dim))
        if self.bidirectional_ca:
            self.kv_ca = residual(Attention(dim))
            self.kv_dense = residual(Dense(dim))

    def forward(self, q: Tensor, kv: Tensor, attn_mask: Tensor | None = None):
        if self.mask_attention:
            attn_mask = attn_mask.detach().clone()
            if FIXED:
                # True values indicate a slot will be included in the attention computation
                # If the attn mask is completely invalid for a given query, allow it to attend everywhere
                attn_mask[torch.where(attn_mask.sum(-1) == 0)] = True
            else:
                # If a BoolTensor is provided, positions with `True` are not allowed to attend
                # if the attn mask is completely invalid for a given query, allow it to attend everywhere
                attn_mask[torch.where(attn_mask.sum(-1) == attn_mask.shape[-1])] = False
        else:
            attn_mask = None
        q = self.q_ca(q, k=kv, v=kv, attn_mask=attn_mask)
        q = self.q_sa(q)
        q = self.q_dense(q)
        if self.bidirectional_ca:
            if attn_mask is not None:
                attn_mask = attn_mask.transpose(-2, -1)
            kv = self.kv_ca(kv, k=q, v=q, attn_mask=attn_mask)
            kv = self.kv_dense(kv)
        return q, kv


class ObjectHitMaskTask(nn.Module):
    def __init__(self, input_hit, dim):
        super().__init__()
        self.input_hit = input_hit
        self.output_object_hit = "track_hit"
        self.hit_net = nn.Linear(dim, dim)
        self.object_net = nn.Linear(dim, dim)

    def forward(self, x):
        hit = self.hit_net(x[self.input_hit + "_embed"])
        obj = self.object_net(x["query_embed"])
        return {self.output_object_hit + "_logit": torch.einsum("bnd,bmd->bnm", obj, hit)}

    def attn_mask(self, outputs, threshold=0.1):
        if FIXED:
            attn_mask = outputs[self.output_object_hit + "_logit"].detach().sigmoid() >= threshold
        else:
            attn_mask = outputs[self.output_object_hit + "_logit"].detach().sigmoid() < threshold
        # If the attn mask is completely padded for a given entry, unpad it
        attn_mask[torch.where(torch.all(attn_mask, dim=-1))] = False
        return {self.input_hit: attn_mask}


class MaskFormer(nn.Module):
    def __init__(self, dim=32, num_queries=6, num_layers=2):
        super().__init__()
        self.hit_embed = nn.Linear(3, dim)
        self.decoder_layers = nn.ModuleList([MaskFormerDecoderLayer(dim) for _ in range(num_layers)])
        self.tasks = nn.ModuleList([ObjectHitMaskTask("hit", dim)])
        self.num_queries = num_queries
        self.query_initial = nn.Parameter(torch.randn(num_queries, dim))

    def forward(self, inputs):
        x = {"hit_embed": self.hit_embed(inputs["hit_xyz"]), "hit_valid": inputs["hit_valid"]}
        x["key_is_hit"] = torch.ones(inputs["hit_valid"].shape[-1], dtype=torch.bool)
        x["key_embed"] = x["hit_embed"]
        batch_size = x["hit_valid"].shape[0]
        x["query_embed"] = self.query_initial.expand(batch_size, -1, -1)
        masks_used = []
        for decoder_layer in self.decoder_layers:
            attn_masks = {}
            for task in self.tasks:
                attn_masks.update(task.attn_mask(task(x)))
            attn_mask = torch.full((batch_size, self.num_queries, x["key_embed"].shape[-2]), False)
            for input_name, input_attn_mask in attn_masks.items():
                attn_mask[..., x[f"key_is_{input_name}"]] = input_attn_mask
            masks_used.append((x["query_embed"], x["key_embed"], attn_mask))
            x["query_embed"], x["key_embed"] = decoder_layer(x["query_embed"], x["key_embed"], attn_mask=attn_mask)
            x["hit_embed"] = x["key_embed"][..., x["key_is_hit"], :]
        return x, masks_used


model = MaskFormer().eval()
# one training-style batch of two events, 24 hits each (3D positions)
inputs = {"hit_xyz": 3 * torch.randn(2, 24, 3), "hit_valid": torch.ones(2, 24, dtype=torch.bool)}
with torch.no_grad():
    x, masks_used = model(inputs)
    # reference: first decoder layer with the mask the model meant (query attends to the hits it predicts it owns)
    q0, kv0, _ = masks_used[0]
    logits = model.tasks[0]({"hit_embed": kv0, "query_embed": q0})["track_hit_logit"]
    owned = logits.sigmoid() >= 0.1
    passed = masks_used[0][2]
    frac = (passed & owned).sum().item() / max(passed.sum().item(), 1)
print(f"fixed={FIXED} fraction of attended (query, hit) slots that the query predicts it owns: {frac:.2f}; "
      f"final query norm {x['query_embed'].norm():.4f}")
