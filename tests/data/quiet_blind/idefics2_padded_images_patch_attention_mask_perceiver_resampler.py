"""Idefics2: images padded to one canvas, patch_attention_mask in the vision encoder and perceiver resampler.

Follows huggingface/transformers src/transformers/models/idefics2/modeling_idefics2.py (recalled):
Idefics2Model.forward (patch_attention_mask from pixel_attention_mask.unfold(...).sum() > 0),
Idefics2VisionEmbeddings (position ids by bucketizing fractional coordinates of the REAL patch grid, so a padded
image gets the same positions as the image alone), the vision encoder's _prepare_4d_attention_mask on the patch
mask (bidirectional, padded patches hidden as keys), Idefics2PerceiverResampler (latents attend to
cat([context, latents]) with mask cat([patch mask, ones])), and inputs_merger (image token embeddings replaced by
the resampled latents).  The Mistral text model is causal over text and image tokens alike, with left padding.
Checked: each image alone at its own size gives the same latents, and each sample alone gives the same logits.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

PATCH, IMAGE_SIZE, D_VIS, D_TXT, N_LATENTS, VOCAB, PAD, IMAGE_TOKEN, FAKE = 8, 32, 32, 32, 4, 40, 0, 3, 4


def _prepare_4d_attention_mask(mask, dtype, tgt_len=None):
    tgt_len = tgt_len or mask.size(1)
    expanded = mask[:, None, None, :].to(dtype).expand(-1, 1, tgt_len, -1)
    inverted = 1.0 - expanded
    return inverted.masked_fill(inverted.bool(), torch.finfo(dtype).min)


class Attention(nn.Module):
    def __init__(self, dim, heads=4):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))
        self.is_causal = False

    def forward(self, x, context=None, attention_mask=None):
        context = x if context is None else context
        b = x.size(0)
        split = lambda t: t.view(b, t.size(1), self.heads, -1).transpose(1, 2)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(context)), split(self.v_proj(context))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=self.is_causal)
        return self.out_proj(out.transpose(1, 2).reshape(b, x.size(1), -1))


class Idefics2VisionEmbeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, D_VIS, PATCH, stride=PATCH)
        self.num_patches_per_side = IMAGE_SIZE // PATCH
        self.position_embedding = nn.Embedding(self.num_patches_per_side ** 2, D_VIS)

    def forward(self, pixel_values, patch_attention_mask):
        batch_size, _, max_im_h, max_im_w = pixel_values.shape
        embeddings = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        max_nb_patches_h, max_nb_patches_w = max_im_h // PATCH, max_im_w // PATCH
        boundaries = torch.arange(1 / self.num_patches_per_side, 1.0, 1 / self.num_patches_per_side)
        position_ids = torch.full((batch_size, max_nb_patches_h * max_nb_patches_w), 0)
        for batch_idx, p_attn_mask in enumerate(patch_attention_mask):
            nb_patches_h, nb_patches_w = p_attn_mask[:, 0].sum(), p_attn_mask[0].sum()
            fractional_coords_h = torch.arange(0, 1 - 1e-6, 1 / nb_patches_h)
            fractional_coords_w = torch.arange(0, 1 - 1e-6, 1 / nb_patches_w)
            bucket_coords_h = torch.bucketize(fractional_coords_h, boundaries, right=True)
            bucket_coords_w = torch.bucketize(fractional_coords_w, boundaries, right=True)
            pos_ids = (bucket_coords_h[:, None] * self.num_patches_per_side + bucket_coords_w).flatten()
            position_ids[batch_idx][p_attn_mask.view(-1)] = pos_ids
        return embeddings + self.position_embedding(position_ids)


class Idefics2VisionTransformer(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embeddings = Idefics2VisionEmbeddings()
        self.attn = nn.ModuleList(Attention(D_VIS) for _ in range(layers))
        self.ln = nn.ModuleList(nn.LayerNorm(D_VIS) for _ in range(layers))
        self.post_layernorm = nn.LayerNorm(D_VIS)

    def forward(self, pixel_values, patch_attention_mask):
        h = self.embeddings(pixel_values, patch_attention_mask)
        patch_attention_mask = patch_attention_mask.view(pixel_values.size(0), -1)
        # no padded patch anywhere: the encoder runs without a mask
        mask = None if not torch.any(~patch_attention_mask) else _prepare_4d_attention_mask(patch_attention_mask, h.dtype)
        for attn, ln in zip(self.attn, self.ln):
            h = h + attn(ln(h), attention_mask=mask)
        return self.post_layernorm(h)


class Idefics2PerceiverResampler(nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.n_latents = N_LATENTS
        self.latents = nn.Parameter(torch.randn(N_LATENTS, D_TXT) * 0.5)
        self.attn = nn.ModuleList(Attention(D_TXT) for _ in range(depth))
        self.input_latents_norm = nn.ModuleList(nn.RMSNorm(D_TXT) for _ in range(depth))
        self.input_context_norm = nn.ModuleList(nn.RMSNorm(D_TXT) for _ in range(depth))
        self.norm = nn.RMSNorm(D_TXT)

    def forward(self, context, attention_mask):
        latents = self.latents.unsqueeze(0).expand(context.shape[0], *self.latents.size())
        latent_attention_mask = torch.ones(attention_mask.size(0), latents.size(1), dtype=attention_mask.dtype)
        attention_mask = torch.cat([attention_mask, latent_attention_mask], dim=-1)
        attention_mask = _prepare_4d_attention_mask(attention_mask, latents.dtype, tgt_len=self.n_latents)
        compressed_context = latents
        for attn, ln_l, ln_c in zip(self.attn, self.input_latents_norm, self.input_context_norm):
            lat = ln_l(compressed_context)
            kv = torch.concat([ln_c(context), lat], dim=-2)
            compressed_context = compressed_context + attn(lat, kv, attention_mask)
        return self.norm(compressed_context)


class Idefics2Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision_model = Idefics2VisionTransformer()
        self.modality_projection = nn.Sequential(nn.Linear(D_VIS, 64), nn.SiLU(), nn.Linear(64, D_TXT))
        self.perceiver_resampler = Idefics2PerceiverResampler()
        self.embed_tokens = nn.Embedding(VOCAB, D_TXT)
        self.text_layers = nn.ModuleList(Attention(D_TXT) for _ in range(2))
        self.text_ln = nn.ModuleList(nn.RMSNorm(D_TXT) for _ in range(2))
        self.lm_head = nn.Linear(D_TXT, VOCAB, bias=False)
        self.rope_base = 10000.0

    def get_image_features(self, pixel_values, pixel_attention_mask):
        patches_subgrid = pixel_attention_mask.unfold(1, PATCH, PATCH).unfold(2, PATCH, PATCH)
        patch_attention_mask = (patches_subgrid.sum(dim=(-1, -2)) > 0).bool()
        image_hidden_states = self.vision_model(pixel_values, patch_attention_mask)
        image_hidden_states = self.modality_projection(image_hidden_states)
        return self.perceiver_resampler(image_hidden_states, patch_attention_mask.view(pixel_values.size(0), -1))

    def inputs_merger(self, input_ids, inputs_embeds, image_hidden_states):
        special_image_token_mask = input_ids == IMAGE_TOKEN
        new_inputs_embeds = inputs_embeds.clone()
        new_inputs_embeds[special_image_token_mask] = image_hidden_states.reshape(-1, D_TXT)
        return new_inputs_embeds

    def forward(self, input_ids, attention_mask, pixel_values, pixel_attention_mask):
        image_hidden_states = self.get_image_features(pixel_values, pixel_attention_mask)
        h = self.inputs_merger(input_ids, self.embed_tokens(input_ids), image_hidden_states)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        t = input_ids.size(1)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        # causal over text and image tokens, left padding hidden as keys
        mask = causal & attention_mask.bool()[:, None, :]
        # AttentionMaskConverter._unmask_unattended: a left-pad query row with no key left attends to all (SDPA
        # would give NaN); those rows are never read
        mask = mask | ~mask.any(-1, keepdim=True)
        ang = position_ids[..., None].float() * (1.0 / self.rope_base ** (torch.arange(0, D_TXT, 2) / D_TXT))
        h = h + torch.cat([ang.sin(), ang.cos()], -1)
        for attn, ln in zip(self.text_layers, self.text_ln):
            h = h + attn(ln(h), attention_mask=mask[:, None])
        return self.lm_head(h), image_hidden_states


def main():
    torch.manual_seed(0)
    model = Idefics2Model().eval()
    images = [torch.randn(3, 16, 24), torch.randn(3, 24, 16)]
    H = max(i.shape[1] for i in images)
    W = max(i.shape[2] for i in images)
    pixel_values = torch.zeros(len(images), 3, H, W)
    pixel_attention_mask = torch.zeros(len(images), H, W, dtype=torch.bool)
    for n, img in enumerate(images):
        pixel_values[n, :, :img.shape[1], :img.shape[2]] = img
        pixel_attention_mask[n, :img.shape[1], :img.shape[2]] = True
    image_span = [FAKE] + [IMAGE_TOKEN] * N_LATENTS + [FAKE]
    prompts = [[5, 6] + image_span + [7, 8, 9], image_span + [10]]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])  # left padding for generation
    attention_mask = (input_ids != PAD).long()
    with torch.no_grad():
        logits, latents = model(input_ids, attention_mask, pixel_values, pixel_attention_mask)
        for n, img in enumerate(images):
            ids = torch.tensor([prompts[n]])
            lg, lat = model(ids, torch.ones_like(ids), img[None], torch.ones(1, *img.shape[1:], dtype=torch.bool))
            torch.testing.assert_close(latents[n], lat[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(logits[n][attention_mask[n].bool()], lg[0], rtol=1e-4, atol=1e-4)
    print("logits", tuple(logits.shape), "next tokens", logits[:, -1].argmax(-1).tolist())


if __name__ == "__main__":
    main()
