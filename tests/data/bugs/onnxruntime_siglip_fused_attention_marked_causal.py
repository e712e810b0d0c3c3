# microsoft/onnxruntime#25360: the CLIP attention fusion (fusion_attention_clip.py) set causal=(add_mask is not None),
# so a SigLIP vision encoder with a patch padding mask was fused into a causal Attention node. Fix: causal only
# when a causal mask subgraph was matched.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class SiglipVisionConfig:
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 2
    intermediate_size = 64
    num_patches = 9


def fuse_clip_attention(add_mask, causal_mask_nodes_1=None, causal_mask_nodes_2=None):
    """What FusionAttentionClip.fuse decides for the fused Attention node."""
    if FIXED:
        causal = (causal_mask_nodes_1 is not None) or (causal_mask_nodes_2 is not None)
    else:
        causal = add_mask is not None
    return {"add_qk": add_mask, "causal": causal}


def ort_attention(q, k, v, attrs):
    """Reference of com.microsoft Attention / MultiHeadAttention with attention_bias and unidirectional."""
    bias = attrs["add_qk"]
    L, S = q.shape[-2], k.shape[-2]
    mask = torch.zeros(L, S, dtype=q.dtype) if bias is None else bias
    if attrs["causal"]:
        causal = torch.ones(L, S, dtype=torch.bool).tril()
        mask = mask.masked_fill(~causal, torch.finfo(q.dtype).min)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class SiglipAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        B, L, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        attrs = fuse_clip_attention(add_mask=attention_mask)
        out = ort_attention(q, k, v, attrs)
        return self.out_proj(out.transpose(1, 2).reshape(B, L, -1))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(approximate="tanh"),
                                 nn.Linear(config.intermediate_size, config.hidden_size))

    def forward(self, hidden_states, attention_mask):
        hidden_states = hidden_states + self.self_attn(self.layer_norm1(hidden_states), attention_mask)
        return hidden_states + self.mlp(self.layer_norm2(hidden_states))


class SiglipVisionTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.patch_embedding = nn.Linear(12, config.hidden_size)
        self.position_embedding = nn.Embedding(config.num_patches, config.hidden_size)
        self.layers = nn.ModuleList([SiglipEncoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.post_layernorm = nn.LayerNorm(config.hidden_size)

    def forward(self, patches, patch_attention_mask):
        B, L, _ = patches.shape
        hidden_states = self.patch_embedding(patches) + self.position_embedding(torch.arange(L))[None]
        # _prepare_4d_attention_mask: [B, L] keep-mask -> additive [B, 1, L, L]
        inverted = 1.0 - patch_attention_mask[:, None, None, :].to(hidden_states.dtype).expand(B, 1, L, L)
        attention_mask = inverted.masked_fill(inverted.bool(), torch.finfo(hidden_states.dtype).min)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask)
        return self.post_layernorm(hidden_states)


config = SiglipVisionConfig()
model = SiglipVisionTransformer(config).eval()
patches = torch.randn(2, config.num_patches, 12)
patch_attention_mask = torch.ones(2, config.num_patches, dtype=torch.bool)
patch_attention_mask[1, 6:] = False  # second image is smaller: its last patches are padding

with torch.no_grad():
    out = model(patches, patch_attention_mask)
    # reference: plain bidirectional attention over the real patches of image 0
    ref = model.layers[0].self_attn
    x = model.patch_embedding(patches[:1]) + model.position_embedding(torch.arange(config.num_patches))[None]
    B, L, _ = x.shape
    h = model.layers[0].layer_norm1(x)
    q = ref.q_proj(h).view(B, L, 4, 8).transpose(1, 2)
    k = ref.k_proj(h).view(B, L, 4, 8).transpose(1, 2)
    v = ref.v_proj(h).view(B, L, 4, 8).transpose(1, 2)
    bidir = F.scaled_dot_product_attention(q, k, v)
    fused = ort_attention(q, k, v, fuse_clip_attention(add_mask=torch.zeros(L, L)))
print(f"fixed={FIXED} pooled[0,:3]={out[0].mean(0)[:3].tolist()} "
      f"max |fused attention - bidirectional| = {(fused - bidir).abs().max().item():.3e}")
