# Quiet (the shape of siglip_naflex_mha_probe_pool_keeps_cls.py, correct): the config states `num_prefix_tokens=1` and
# `pool_include_prefix=False`; the probe is handed all N tokens, and its key_padding_mask hides the class token as it
# hides the patches' padding, so the pool reads the patches alone. No finding.
import torch
import torch.nn as nn

torch.manual_seed(0)


class Encoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d, h = cfg["dim"], cfg["heads"]
        self.heads = h
        self.patch = nn.Linear(cfg["patch_dim"], d)
        self.cls = nn.Parameter(torch.randn(1, cfg["num_prefix_tokens"], d) * 0.02)
        self.qkv = nn.ModuleList([nn.Linear(d, 3 * d) for _ in range(cfg["depth"])])
        self.out = nn.ModuleList([nn.Linear(d, d) for _ in range(cfg["depth"])])
        self.probe = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pool = nn.MultiheadAttention(d, h, batch_first=True)
        self.head = nn.Linear(d, cfg["classes"])

    def attend(self, i, x, keep):
        B, N, D = x.shape
        q, k, v = self.qkv[i](x).view(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / (D // self.heads) ** 0.5
        scores = scores.masked_fill(~keep, float("-inf"))
        return x + self.out[i]((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, N, D))

    def forward(self, patches, patch_valid):
        B = patches.shape[0]
        P = self.cfg["num_prefix_tokens"]
        x = torch.cat([self.cls.expand(B, -1, -1), self.patch(patches)], dim=1)
        valid = torch.cat([patch_valid.new_ones(B, P), patch_valid], dim=1)
        keep = (valid[:, None, :, None] & valid[:, None, None, :]) | torch.eye(x.shape[1], dtype=torch.bool)
        for i in range(self.cfg["depth"]):
            x = self.attend(i, x, keep)
        if not self.cfg["pool_include_prefix"]:
            valid = torch.cat([patch_valid.new_zeros(B, P), patch_valid], dim=1)  # the prefix hidden from the probe
        pooled, _ = self.pool(self.probe.expand(B, -1, -1), x, x, key_padding_mask=~valid)
        return self.head(pooled[:, 0])


cfg = dict(dim=32, heads=4, depth=2, patch_dim=12, classes=5, num_prefix_tokens=1, global_pool="map",
           pool_include_prefix=False)
model = Encoder(cfg)
lengths = torch.tensor([9, 6])  # images of 9 and 6 patches, right-padded to 9
patch_valid = torch.arange(9)[None, :] < lengths[:, None]
patches = torch.randn(2, 9, 12) * patch_valid[..., None]
logits = model(patches, patch_valid)
loss = nn.functional.cross_entropy(logits, torch.tensor([1, 3]))
loss.backward()
print("loss %.5f" % loss.item())
