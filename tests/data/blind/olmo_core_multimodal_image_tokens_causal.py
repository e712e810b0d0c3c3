"""OLMo-core MultimodalLM runs the LM fully causal over spliced image tokens (Molmo2 is bidirectional).

Citation: allenai/OLMo-core#726 ("Add bidirectional image-token attention to MultimodalLM",
merged into the ``vision`` integration branch). Written from the PR description; the module
names follow it (MultimodalLM.forward, token_type_ids, or_mask, TorchAttentionBackend).

Bug: HF Molmo2 attends bidirectionally among image tokens (driven by ``token_type_ids``) while
text stays causal. OLMo-core's MultimodalLM ignored token_type_ids and ran the LM with the plain
causal mask, so an image patch could not see later patches of the image. Parity tests missed
it: one test used a single <im_patch> token (causal == bidirectional), the other never passed
token_type_ids to HF either.

Fix: MultimodalLM.forward takes ``token_type_ids`` and builds a (B, 1, S, S) boolean
``or_mask`` (True where image[q] & image[k]) that TorchAttentionBackend ORs onto the causal base.

This program: two prompts, each <bos> + 2 text + 6 image-patch tokens + text, the processor's
batch carrying token_type_ids (1 on image patches), LM attention through SDPA.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv

IM_PATCH_ID = 7


class TorchAttentionBackend:
    SUPPORTS_OR_MASK = True

    def __call__(self, q, k, v, or_mask=None):
        if or_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        S = q.shape[-2]
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal | or_mask)


class Attention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.w_qkv = nn.Linear(d_model, 3 * d_model)
        self.w_out = nn.Linear(d_model, d_model)
        self.backend = TorchAttentionBackend()

    def forward(self, x, or_mask=None):
        B, S, D = x.shape
        q, k, v = self.w_qkv(x).view(B, S, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        att = self.backend(q, k, v, or_mask=or_mask)
        return self.w_out(att.transpose(1, 2).reshape(B, S, D))


class Transformer(nn.Module):
    def __init__(self, vocab, d_model, n_heads, n_layers):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Attention(d_model, n_heads) for _ in range(n_layers))
        self.lm_head = nn.Linear(d_model, vocab)

    def forward(self, h, **block_kwargs):
        for block in self.blocks:
            h = h + block(h, **block_kwargs)
        return self.lm_head(h)


class MultimodalLM(nn.Module):
    def __init__(self, vocab=32, d_model=32, n_heads=2, n_layers=2, vit_dim=12):
        super().__init__()
        self.transformer = Transformer(vocab, d_model, n_heads, n_layers)
        self.image_projector = nn.Linear(vit_dim, d_model)

    def forward(self, input_ids, image_features, token_type_ids=None, **kwargs):
        h = self.transformer.embeddings(input_ids)
        is_patch = input_ids == IM_PATCH_ID
        h = h.masked_scatter(is_patch[..., None], self.image_projector(image_features).to(h.dtype))
        block_kwargs = {}
        if FIXED and token_type_ids is not None:
            image = token_type_ids == 1
            block_kwargs["or_mask"] = (image[:, :, None] & image[:, None, :])[:, None]
        return self.transformer(h, **block_kwargs)


def processor(prompts, n_patches=6):
    """Molmo2-style processor output: <im_patch> placeholders plus token_type_ids."""
    input_ids, token_type_ids = [], []
    for text_before, text_after in prompts:
        ids = [1] + text_before + [IM_PATCH_ID] * n_patches + text_after
        input_ids.append(ids)
        token_type_ids.append([1 if t == IM_PATCH_ID else 0 for t in ids])
    return {"input_ids": torch.tensor(input_ids), "token_type_ids": torch.tensor(token_type_ids)}


def main():
    torch.manual_seed(0)
    model = MultimodalLM().eval()
    batch = processor([([3, 4], [5, 6, 8]), ([9, 10], [11, 12, 13])])
    image_features = torch.randn(2 * 6, 12)  # pooled ViT features, one row per <im_patch>
    with torch.no_grad():
        logits = model(**batch, image_features=image_features)
    print(f"logits {tuple(logits.shape)} last-token norm {logits[:, -1].norm():.4f}")


if __name__ == "__main__":
    main()
