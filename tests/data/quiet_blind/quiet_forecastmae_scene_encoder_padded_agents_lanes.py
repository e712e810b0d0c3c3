# Citation: jchengai/forecast-mae src/model/model_forecast.py, src/model/layers/transformer_blocks.py,
#   src/datamodule/av2_dataset.py collate_fn (commit cb86ea92601d23a8af7713389e9fb78d7e546a65)
# Agents and lane polylines are padded per scene; key_padding_mask = cat(x_padding_mask.all(-1), lane_padding_mask.all(-1))
# (bool, True = padded agent/lane) goes to nn.MultiheadAttention; the focal agent (index 0) is always valid so no row is empty.
# Adaptation: the NATTEN agent history encoder is replaced by a 1-D conv + max over valid steps (no attention there).
import torch
import torch.nn as nn
import torch.nn.functional as F
from typing import Optional
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, drop=0.0):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_features, out_features)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x):
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, drop=0.0, attn_drop=0.0, drop_path=0.0,
                 act_layer=nn.GELU, norm_layer=nn.LayerNorm, post_norm=False):
        super().__init__()
        self.post_norm = post_norm
        self.norm1 = norm_layer(dim)
        self.attn = torch.nn.MultiheadAttention(dim, num_heads=num_heads, add_bias_kv=qkv_bias, dropout=attn_drop,
                                                batch_first=True)
        self.drop_path1 = nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, drop=drop)
        self.drop_path2 = nn.Identity()

    def forward_pre(self, src, mask: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None):
        src2 = self.norm1(src)
        src2 = self.attn(query=src2, key=src2, value=src2, attn_mask=mask, key_padding_mask=key_padding_mask)[0]
        src = src + self.drop_path1(src2)
        src = src + self.drop_path2(self.mlp(self.norm2(src)))
        return src

    def forward(self, src, mask=None, key_padding_mask=None):
        return self.forward_pre(src=src, mask=mask, key_padding_mask=key_padding_mask)


class LaneEmbeddingLayer(nn.Module):
    def __init__(self, feat_channel, encoder_channel):
        super().__init__()
        self.encoder_channel = encoder_channel
        self.first_conv = nn.Sequential(nn.Conv1d(feat_channel, 128, 1), nn.BatchNorm1d(128), nn.ReLU(inplace=True),
                                        nn.Conv1d(128, 256, 1))
        self.second_conv = nn.Sequential(nn.Conv1d(512, 256, 1), nn.BatchNorm1d(256), nn.ReLU(inplace=True),
                                         nn.Conv1d(256, self.encoder_channel, 1))

    def forward(self, x):
        bs, n, _ = x.shape
        feature = self.first_conv(x.transpose(2, 1))
        feature_global = torch.max(feature, dim=2, keepdim=True)[0]
        feature = torch.cat([feature_global.expand(-1, -1, n), feature], dim=1)
        feature = self.second_conv(feature)
        return torch.max(feature, dim=2, keepdim=False)[0]


class AgentEmbeddingLayer(nn.Module):
    # stand-in for the NATTEN-based encoder: conv over time, max pool
    def __init__(self, in_chans, embed_dim):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(in_chans, embed_dim, 3, padding=1), nn.GELU(), nn.Conv1d(embed_dim, embed_dim * 4, 1))

    def forward(self, x):
        return self.conv(x).max(dim=-1)[0]


class MultimodalDecoder(nn.Module):
    def __init__(self, embed_dim, future_steps):
        super().__init__()
        self.embed_dim = embed_dim
        self.future_steps = future_steps
        self.multimodal_proj = nn.Linear(embed_dim, 6 * embed_dim)
        self.loc = nn.Sequential(nn.Linear(embed_dim, 256), nn.ReLU(), nn.Linear(256, embed_dim), nn.ReLU(),
                                 nn.Linear(embed_dim, future_steps * 2))
        self.pi = nn.Sequential(nn.Linear(embed_dim, 256), nn.ReLU(), nn.Linear(256, embed_dim), nn.ReLU(), nn.Linear(embed_dim, 1))

    def forward(self, x):
        x = self.multimodal_proj(x).view(-1, 6, self.embed_dim)
        loc = self.loc(x).view(-1, 6, self.future_steps, 2)
        pi = self.pi(x).squeeze(-1)
        return loc, pi


class ModelForecast(nn.Module):
    def __init__(self, embed_dim=64, encoder_depth=2, num_heads=4, mlp_ratio=4.0, qkv_bias=False, drop_path=0.0,
                 future_steps: int = 60):
        super().__init__()
        self.hist_embed = AgentEmbeddingLayer(4, embed_dim // 4)
        self.lane_embed = LaneEmbeddingLayer(3, embed_dim)
        self.pos_embed = nn.Sequential(nn.Linear(4, embed_dim), nn.GELU(), nn.Linear(embed_dim, embed_dim))
        self.blocks = nn.ModuleList(Block(dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias)
                                    for i in range(encoder_depth))
        self.norm = nn.LayerNorm(embed_dim)
        self.actor_type_embed = nn.Parameter(torch.randn(4, embed_dim) * 0.02)
        self.lane_type_embed = nn.Parameter(torch.randn(1, 1, embed_dim) * 0.02)
        self.decoder = MultimodalDecoder(embed_dim, future_steps)
        self.dense_predictor = nn.Sequential(nn.Linear(embed_dim, 256), nn.ReLU(), nn.Linear(256, future_steps * 2))

    def forward(self, data):
        hist_padding_mask = data["x_padding_mask"][:, :, :50]
        hist_key_padding_mask = data["x_key_padding_mask"]
        hist_feat = torch.cat([data["x"], data["x_velocity_diff"][..., None], ~hist_padding_mask[..., None]], dim=-1)
        B, N, L, D = hist_feat.shape
        hist_feat = hist_feat.view(B * N, L, D)
        hist_feat_key_padding = hist_key_padding_mask.view(B * N)
        actor_feat = self.hist_embed(hist_feat[~hist_feat_key_padding].permute(0, 2, 1).contiguous())
        actor_feat_tmp = torch.zeros(B * N, actor_feat.shape[-1], device=actor_feat.device)
        actor_feat_tmp[~hist_feat_key_padding] = actor_feat
        actor_feat = actor_feat_tmp.view(B, N, actor_feat.shape[-1])

        lane_padding_mask = data["lane_padding_mask"]
        lane_normalized = data["lane_positions"] - data["lane_centers"].unsqueeze(-2)
        lane_normalized = torch.cat([lane_normalized, ~lane_padding_mask[..., None]], dim=-1)
        B, M, L, D = lane_normalized.shape
        lane_feat = self.lane_embed(lane_normalized.view(-1, L, D).contiguous())
        lane_feat = lane_feat.view(B, M, -1)

        x_centers = torch.cat([data["x_centers"], data["lane_centers"]], dim=1)
        angles = torch.cat([data["x_angles"][:, :, 49], data["lane_angles"]], dim=1)
        x_angles = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)
        pos_feat = torch.cat([x_centers, x_angles], dim=-1)
        pos_embed = self.pos_embed(pos_feat)

        actor_type_embed = self.actor_type_embed[data["x_attr"][..., 2].long()]
        lane_type_embed = self.lane_type_embed.repeat(B, M, 1)
        actor_feat += actor_type_embed
        lane_feat += lane_type_embed

        x_encoder = torch.cat([actor_feat, lane_feat], dim=1)
        key_padding_mask = torch.cat([data["x_key_padding_mask"], data["lane_key_padding_mask"]], dim=1)

        x_encoder = x_encoder + pos_embed
        for blk in self.blocks:
            x_encoder = blk(x_encoder, key_padding_mask=key_padding_mask)
        x_encoder = self.norm(x_encoder)

        x_agent = x_encoder[:, 0]
        y_hat, pi = self.decoder(x_agent)
        x_others = x_encoder[:, 1:N]
        y_hat_others = self.dense_predictor(x_others).view(B, -1, 60, 2)
        return {"y_hat": y_hat, "pi": pi, "y_hat_others": y_hat_others}


def make_scene(num_agents, num_lanes):
    x_padding_mask = torch.rand(num_agents, 110) < 0.2
    x_padding_mask[:, 49] = False  # every kept agent is observed at the current step
    x_padding_mask[0] = False  # focal agent fully observed
    lane_padding_mask = torch.rand(num_lanes, 20) < 0.1
    lane_padding_mask[:, 0] = False
    return {
        "x": torch.randn(num_agents, 50, 2), "x_attr": torch.randint(0, 4, (num_agents, 3)),
        "x_centers": torch.randn(num_agents, 2), "x_angles": torch.randn(num_agents, 110),
        "x_velocity_diff": torch.randn(num_agents, 50), "y": torch.randn(num_agents, 60, 2),
        "lane_positions": torch.randn(num_lanes, 20, 2), "lane_centers": torch.randn(num_lanes, 2),
        "lane_angles": torch.randn(num_lanes), "x_padding_mask": x_padding_mask, "lane_padding_mask": lane_padding_mask,
    }


def collate_fn(batch):
    data = {}
    for key in ["x", "x_attr", "x_centers", "x_angles", "x_velocity_diff", "lane_positions", "lane_centers", "lane_angles", "y"]:
        data[key] = pad_sequence([b[key] for b in batch], batch_first=True)
    for key in ["x_padding_mask", "lane_padding_mask"]:
        data[key] = pad_sequence([b[key] for b in batch], batch_first=True, padding_value=True)
    data["x_key_padding_mask"] = data["x_padding_mask"].all(-1)
    data["lane_key_padding_mask"] = data["lane_padding_mask"].all(-1)
    data["num_actors"] = (~data["x_key_padding_mask"]).sum(-1)
    data["num_lanes"] = (~data["lane_key_padding_mask"]).sum(-1)
    return data


def cal_loss(out, data):
    y_hat, pi, y_hat_others = out["y_hat"], out["pi"], out["y_hat_others"]
    y, y_others = data["y"][:, 0], data["y"][:, 1:]
    l2_norm = torch.norm(y_hat[..., :2] - y.unsqueeze(1), dim=-1).sum(dim=-1)
    best_mode = torch.argmin(l2_norm, dim=-1)
    y_hat_best = y_hat[torch.arange(y_hat.shape[0]), best_mode]
    agent_reg_loss = F.smooth_l1_loss(y_hat_best[..., :2], y)
    agent_cls_loss = F.cross_entropy(pi, best_mode.detach())
    others_reg_mask = ~data["x_padding_mask"][:, 1:, 50:]
    others_reg_loss = F.smooth_l1_loss(y_hat_others[others_reg_mask], y_others[others_reg_mask])
    return agent_reg_loss + agent_cls_loss + others_reg_loss


if __name__ == "__main__":
    torch.manual_seed(0)
    data = collate_fn([make_scene(5, 9), make_scene(2, 4), make_scene(7, 6)])
    model = ModelForecast()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        loss = cal_loss(model(data), data)
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("loss %.4f" % loss.item())
