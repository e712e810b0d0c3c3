"""vLLM Idefics2 vision tower (MiniCPM-o 4.5) ran ViT attention without the patch mask.

Citation: vllm-project/vllm PR #34127 ("fix minicpmo4.5: fix attn_mask in vit attn && fix
resampler pos_emb ...", merged).  The PR description and one review hunk (the new
`F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, ...)` branch in
vllm/model_executor/models/idefics2_vision_model.py) were read, not the whole diff; the rest of
the tower below is written after that file and MiniCPM-V's `get_vision_embedding`.

Bug: MiniCPM-V batches image slices of different sizes by padding their patch sequences to
`max_patches` and passes `patch_attention_mask` (True on the `tgt_h * tgt_w` real patches)
plus `tgt_sizes` to the vision tower.  The vLLM tower used the mask only for the position
embeddings; "Attn_mask is not entered in ViT's Attention", so the real patches of a small
slice attended to the zero-padded patches of the batch.
Fix: turn `patch_attention_mask` into a key mask and pass it as `attn_mask` to SDPA in each
encoder layer.

Reproduction: two slices with tgt_sizes (2, 3) and (2, 2) padded to 6 patches, through an
Idefics2-style encoder layer with SDPA.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Idefics2VisionAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads_per_partition = num_heads
        self.head_dim = embed_dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, _ = hidden_states.shape
        query, key, value = self.qkv_proj(hidden_states).chunk(3, dim=-1)
        shape = (bsz, q_len, self.num_heads_per_partition, self.head_dim)
        query, key, value = (t.view(shape).transpose(1, 2) for t in (query, key, value))
        if attention_mask is not None:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                                 scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(query, key, value, scale=self.scale)
        out = out.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.out_proj(out)


class Idefics2EncoderLayer(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(embed_dim)
        self.self_attn = Idefics2VisionAttention(embed_dim, num_heads)

    def forward(self, hidden_states, attention_mask=None):
        return hidden_states + self.self_attn(self.layer_norm1(hidden_states), attention_mask=attention_mask)


class Idefics2VisionTransformer(nn.Module):
    def __init__(self, embed_dim=16, num_heads=2, patch_dim=12):
        super().__init__()
        self.patch_embedding = nn.Linear(patch_dim, embed_dim)
        self.layers = nn.ModuleList([Idefics2EncoderLayer(embed_dim, num_heads)])

    def forward(self, pixel_values, patch_attention_mask=None, tgt_sizes=None):
        hidden_states = self.patch_embedding(pixel_values)
        attention_mask = None
        if FIXED and patch_attention_mask is not None:
            # [B, 1, max_patches] -> [B, 1, 1, max_patches] boolean key mask
            attention_mask = patch_attention_mask.view(patch_attention_mask.shape[0], 1, 1, -1)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=attention_mask)
        return hidden_states


def get_vision_embedding(vpm, pixel_values_list, tgt_sizes):
    all_pixel_values = [p.flatten(end_dim=-2) for p in pixel_values_list]
    tgt_sizes = torch.vstack(tgt_sizes).type(torch.int32)
    max_patches = int(torch.max(tgt_sizes[:, 0] * tgt_sizes[:, 1]))
    all_pixel_values = torch.nn.utils.rnn.pad_sequence(all_pixel_values, batch_first=True, padding_value=0.0)
    B, L, _ = all_pixel_values.shape
    patch_attn_mask = torch.zeros((B, 1, max_patches), dtype=torch.bool)
    for i in range(B):
        patch_attn_mask[i, 0, :tgt_sizes[i][0] * tgt_sizes[i][1]] = True
    return vpm(all_pixel_values, patch_attention_mask=patch_attn_mask, tgt_sizes=tgt_sizes)


def main():
    torch.manual_seed(0)
    vpm = Idefics2VisionTransformer()
    tgt_sizes = [torch.tensor([2, 3]), torch.tensor([2, 2])]
    pixel_values_list = [torch.randn(int(h) * int(w), 12) for h, w in tgt_sizes]
    with torch.no_grad():
        vision_embedding = get_vision_embedding(vpm, pixel_values_list, tgt_sizes)
    print("slice 1 patch 0 out[:3] =", [round(x, 4) for x in vision_embedding[1, 0, :3].tolist()])


if __name__ == "__main__":
    main()
