# huggingface/diffusers#12893 (fix proposed in huggingface/diffusers#13131): ZImageTransformer2DModel measures
# cap_item_seqlens after patchify_and_embed has padded each caption to a multiple of SEQ_MULTI_OF, so the
# caption and unified attention masks let every token attend the inner caption padding.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

SEQ_MULTI_OF = 8
DIM, HEADS, CAP_DIM, PATCH_DIM = 32, 4, 24, 16


class ZImageTransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.to_qkv = nn.Linear(DIM, 3 * DIM)
        self.to_out = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.ff = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.SiLU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x, attn_mask):
        B, L, _ = x.shape
        q, k, v = self.to_qkv(self.norm1(x)).view(B, L, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask[:, None, None, :])
        x = x + self.to_out(h.transpose(1, 2).reshape(B, L, DIM))
        return x + self.ff(self.norm2(x))


class ZImageTransformer2DModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.x_embedder = nn.Linear(PATCH_DIM, DIM)
        self.cap_embedder = nn.Linear(CAP_DIM, DIM)
        self.x_pad_token = nn.Parameter(torch.randn(DIM))
        self.cap_pad_token = nn.Parameter(torch.randn(DIM))
        self.noise_refiner = nn.ModuleList([ZImageTransformerBlock()])
        self.context_refiner = nn.ModuleList([ZImageTransformerBlock()])
        self.layers = nn.ModuleList([ZImageTransformerBlock(), ZImageTransformerBlock()])
        self.final_layer = nn.Linear(DIM, PATCH_DIM)

    def patchify_and_embed(self, all_x, all_cap_feats):
        xs, caps, x_pad_masks, cap_pad_masks = [], [], [], []
        for x, cap in zip(all_x, all_cap_feats):
            cap_pad = (-len(cap)) % SEQ_MULTI_OF
            cap_padded = torch.cat([cap, cap[-1:].repeat(cap_pad, 1)])
            caps.append(cap_padded)
            cap_pad_masks.append(torch.cat([torch.zeros(len(cap), dtype=torch.bool), torch.ones(cap_pad, dtype=torch.bool)]))
            x_pad = (-len(x)) % SEQ_MULTI_OF
            xs.append(torch.cat([x, x[-1:].repeat(x_pad, 1)]))
            x_pad_masks.append(torch.cat([torch.zeros(len(x), dtype=torch.bool), torch.ones(x_pad, dtype=torch.bool)]))
        return xs, caps, x_pad_masks, cap_pad_masks

    @staticmethod
    def pad_batch(feats, inner_pad_masks):
        item_seqlens = [len(f) for f in feats]
        max_len = max(item_seqlens)
        out = torch.stack([F.pad(f, (0, 0, 0, max_len - len(f))) for f in feats])
        attn_mask = torch.zeros(len(feats), max_len, dtype=torch.bool)
        for i, seq_len in enumerate(item_seqlens):
            if FIXED:
                attn_mask[i, :seq_len] = ~inner_pad_masks[i]
            else:
                attn_mask[i, :seq_len] = 1
        return out, attn_mask

    def forward(self, all_x, all_cap_feats):
        xs, caps, x_inner, cap_inner = self.patchify_and_embed(all_x, all_cap_feats)
        x_item_seqlens = [len(x) for x in xs]
        x = self.x_embedder(torch.cat(xs))
        x[torch.cat(x_inner)] = self.x_pad_token
        x, x_attn_mask = self.pad_batch(list(x.split(x_item_seqlens)), x_inner)
        for layer in self.noise_refiner:
            x = layer(x, x_attn_mask)

        cap_item_seqlens = [len(c) for c in caps]
        cap = self.cap_embedder(torch.cat(caps))
        cap[torch.cat(cap_inner)] = self.cap_pad_token
        cap, cap_attn_mask = self.pad_batch(list(cap.split(cap_item_seqlens)), cap_inner)
        for layer in self.context_refiner:
            cap = layer(cap, cap_attn_mask)

        unified = torch.cat([x, cap], dim=1)
        unified_mask = torch.cat([x_attn_mask, cap_attn_mask], dim=1)
        for layer in self.layers:
            unified = layer(unified, unified_mask)
        return [self.final_layer(unified[i, :len(x0)]) for i, x0 in enumerate(all_x)]


def main():
    model = ZImageTransformer2DModel().eval()
    all_x = [torch.randn(8, PATCH_DIM), torch.randn(8, PATCH_DIM)]      # 2x4 latent patches per image
    all_cap = [torch.randn(5, CAP_DIM), torch.randn(11, CAP_DIM)]       # prompts of 5 and 11 tokens
    with torch.no_grad():
        out = model(all_x, all_cap)
        model.cap_pad_token.add_(torch.randn(DIM))  # the value of the padding slots should not matter
        out2 = model(all_x, all_cap)
    d = max((a - b).abs().max().item() for a, b in zip(out, out2))
    print(f"{'fixed' if FIXED else 'buggy'}: image output change when only the caption pad token changes: {d:.4e}")


if __name__ == "__main__":
    main()
