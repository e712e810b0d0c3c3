"""ACT (Action Chunking with Transformers, ALOHA) policy: several cameras in one encoder sequence, action queries.

Follows tonyzhaozh/act detr/models/detr_vae.py (DETRVAE.forward: per-camera backbone features concatenated
along width, latent + proprio tokens prepended) and detr/models/transformer.py (Transformer.forward with
src_key_padding_mask=None in the encoder, tgt_mask=None for the decoder over num_queries action slots).
Recalled, not read line by line.

Masks meant: none. All camera views, the style latent and the joint-state token form one bidirectional
encoder sequence (views are MEANT to attend each other: the policy fuses them). The decoder's k action
queries predict a whole chunk jointly and attend each other bidirectionally (no causal mask: they are not
generated one by one). Every camera image has the same size, so no key is padding.
"""
import torch
import torch.nn as nn
import warnings

warnings.filterwarnings("ignore", message="enable_nested_tensor")

torch.manual_seed(0)


class DETRVAELite(nn.Module):
    def __init__(self, camera_names, hidden_dim=32, num_queries=8, state_dim=14, nheads=4):
        super().__init__()
        self.camera_names = camera_names
        self.backbone = nn.Conv2d(3, hidden_dim, 8, 8)  # stands in for ResNet18 + input_proj
        self.transformer = nn.Transformer(hidden_dim, nheads, 2, 2, 64, dropout=0.0, batch_first=False)
        self.query_embed = nn.Embedding(num_queries, hidden_dim)
        self.input_proj_robot_state = nn.Linear(state_dim, hidden_dim)
        self.latent_out_proj = nn.Linear(32, hidden_dim)
        self.action_head = nn.Linear(hidden_dim, state_dim)

    def forward(self, qpos, image):
        bs = qpos.shape[0]
        latent_input = self.latent_out_proj(torch.zeros(bs, 32))  # inference: prior mean of z
        all_cam_features = [self.backbone(image[:, cam_id]) for cam_id, _ in enumerate(self.camera_names)]
        src = torch.cat(all_cam_features, dim=3)                  # fold cameras along width
        src = src.flatten(2).permute(2, 0, 1)                     # (HW*cams, bs, d)
        proprio = self.input_proj_robot_state(qpos)
        src = torch.cat([torch.stack([latent_input, proprio], 0), src], 0)
        tgt = self.query_embed.weight.unsqueeze(1).repeat(1, bs, 1)
        hs = self.transformer(src, tgt)                          # no masks: joint fusion, parallel chunk
        return self.action_head(hs.transpose(0, 1)), src, tgt


cams = ["cam_high", "cam_left_wrist", "cam_right_wrist"]
policy = DETRVAELite(cams).eval()
qpos = torch.randn(2, 14)
image = torch.rand(2, len(cams), 3, 24, 32)
with torch.no_grad():
    a_hat, src, tgt = policy(qpos, image)
    # reference: the same layers run by hand with explicit softmax(q k^T) and no mask
    def mha(layer, x, mem):
        w, b = layer.in_proj_weight, layer.in_proj_bias
        d = x.shape[-1]
        q = (x @ w[:d].T + b[:d]).view(x.shape[0], -1, 4, 8).permute(1, 2, 0, 3)
        k = (mem @ w[d:2 * d].T + b[d:2 * d]).view(mem.shape[0], -1, 4, 8).permute(1, 2, 0, 3)
        v = (mem @ w[2 * d:].T + b[2 * d:]).view(mem.shape[0], -1, 4, 8).permute(1, 2, 0, 3)
        o = ((q @ k.transpose(-1, -2)) / 8 ** 0.5).softmax(-1) @ v
        return layer.out_proj(o.permute(2, 0, 1, 3).reshape(x.shape[0], -1, d))
    x = src
    for lyr in policy.transformer.encoder.layers:
        x = lyr.norm1(x + mha(lyr.self_attn, x, x))
        x = lyr.norm2(x + lyr.linear2(lyr.activation(lyr.linear1(x))))
    mem = policy.transformer.encoder.norm(x)
    y = tgt
    for lyr in policy.transformer.decoder.layers:
        y = lyr.norm1(y + mha(lyr.self_attn, y, y))
        y = lyr.norm2(y + mha(lyr.multihead_attn, y, mem))
        y = lyr.norm3(y + lyr.linear2(lyr.activation(lyr.linear1(y))))
    ref = policy.action_head(policy.transformer.decoder.norm(y).transpose(0, 1))
    assert torch.allclose(a_hat, ref, atol=1e-5)
print(f"encoder tokens={src.shape[0]} ({len(cams)} cameras + latent + proprio) chunk={a_hat.shape[1]} ok")
