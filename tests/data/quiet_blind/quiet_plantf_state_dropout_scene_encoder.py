# Citation: jchengai/planTF src/models/planTF/planning_model.py, src/models/planTF/modules/agent_encoder.py
#   (AgentEncoder, StateAttentionEncoder), src/models/planTF/layers/transformer_encoder_layer.py,
#   src/models/planTF/modules/trajectory_decoder.py, src/models/planTF/lightning_trainer.py (commit f54060850649710af8999c12d50598c8aeaa69aa)
# StateAttentionEncoder: one learned query attends over 6 ego-state tokens; in training a bool key_padding_mask drops
# state tokens 3..5 at random while tokens 0..2 are always visible, so no query row is ever empty (eval: mask=None).
# Scene encoder: key_padding_mask = cat(~agent_valid.any(-1), ~polygon_valid.any(-1)) (True = padded agent/polygon).
# Adaptation: NAT history encoder and PointNet map encoder replaced by masked conv/max-pool stand-ins (no attention).
import torch
import torch.nn as nn
import torch.nn.functional as F
from typing import Optional
from torch import Tensor


def build_mlp(c_in, channels, norm=None):
    layers = []
    for k in range(len(channels)):
        if k == len(channels) - 1:
            layers.append(nn.Linear(c_in, channels[k], bias=True))
        else:
            if norm is None:
                layers.extend([nn.Linear(c_in, channels[k], bias=True), nn.ReLU()])
            else:
                layers.extend([nn.Linear(c_in, channels[k], bias=False), nn.LayerNorm(channels[k]), nn.ReLU()])
            c_in = channels[k]
    return nn.Sequential(*layers)


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, drop=0.0):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_features, out_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TransformerEncoderLayer(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, drop=0.0, attn_drop=0.0, drop_path=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = torch.nn.MultiheadAttention(dim, num_heads=num_heads, add_bias_kv=qkv_bias, dropout=attn_drop, batch_first=True)
        self.drop_path1 = nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio))
        self.drop_path2 = nn.Identity()

    def forward(self, src, mask: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None):
        src2 = self.norm1(src)
        src2 = self.attn(query=src2, key=src2, value=src2, attn_mask=mask, key_padding_mask=key_padding_mask)[0]
        src = src + self.drop_path1(src2)
        src = src + self.drop_path2(self.mlp(self.norm2(src)))
        return src


class StateAttentionEncoder(nn.Module):
    def __init__(self, state_channel, dim, state_dropout=0.5) -> None:
        super().__init__()
        self.state_channel = state_channel
        self.state_dropout = state_dropout
        self.linears = nn.ModuleList([nn.Linear(1, dim) for _ in range(state_channel)])
        self.attn = nn.MultiheadAttention(embed_dim=dim, num_heads=4, batch_first=True)
        self.pos_embed = nn.Parameter(torch.Tensor(1, state_channel, dim))
        self.query = nn.Parameter(torch.Tensor(1, 1, dim))
        nn.init.normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.query, std=0.02)

    def forward(self, x):
        x_embed = []
        for i, linear in enumerate(self.linears):
            x_embed.append(linear(x[:, i, None]))
        x_embed = torch.stack(x_embed, dim=1)
        pos_embed = self.pos_embed.repeat(x_embed.shape[0], 1, 1)
        x_embed += pos_embed
        if self.training and self.state_dropout > 0:
            visible_tokens = torch.zeros((x_embed.shape[0], 3), device=x.device, dtype=torch.bool)
            dropout_tokens = torch.rand((x_embed.shape[0], self.state_channel - 3), device=x.device) < self.state_dropout
            key_padding_mask = torch.concat([visible_tokens, dropout_tokens], dim=1)
        else:
            key_padding_mask = None
        query = self.query.repeat(x_embed.shape[0], 1, 1)
        x_state = self.attn(query=query, key=x_embed, value=x_embed, key_padding_mask=key_padding_mask)[0]
        return x_state[:, 0]


class AgentEncoder(nn.Module):
    def __init__(self, state_channel=6, history_channel=9, dim=64, hist_steps=21, state_dropout=0.75):
        super().__init__()
        self.dim = dim
        self.state_channel = state_channel
        self.hist_steps = hist_steps
        self.history_encoder = nn.Sequential(nn.Conv1d(history_channel, dim, 3, padding=1), nn.GELU(), nn.Conv1d(dim, dim, 1))
        self.ego_state_emb = StateAttentionEncoder(state_channel, dim, state_dropout)
        self.type_emb = nn.Embedding(4, dim)

    @staticmethod
    def to_vector(feat, valid_mask):
        vec_mask = valid_mask[..., :-1] & valid_mask[..., 1:]
        while len(vec_mask.shape) < len(feat.shape):
            vec_mask = vec_mask.unsqueeze(-1)
        return torch.where(vec_mask, feat[:, :, 1:, ...] - feat[:, :, :-1, ...], torch.zeros_like(feat[:, :, 1:, ...]))

    def forward(self, data):
        T = self.hist_steps
        position = data["agent"]["position"][:, :, :T]
        heading = data["agent"]["heading"][:, :, :T]
        velocity = data["agent"]["velocity"][:, :, :T]
        shape = data["agent"]["shape"][:, :, :T]
        category = data["agent"]["category"].long()
        valid_mask = data["agent"]["valid_mask"][:, :, :T]
        heading_vec = self.to_vector(heading, valid_mask)
        valid_mask_vec = valid_mask[..., 1:] & valid_mask[..., :-1]
        agent_feature = torch.cat([self.to_vector(position, valid_mask), self.to_vector(velocity, valid_mask),
                                   torch.stack([heading_vec.cos(), heading_vec.sin()], dim=-1), shape[:, :, 1:],
                                   valid_mask_vec.float().unsqueeze(-1)], dim=-1)
        bs, A, T, _ = agent_feature.shape
        agent_feature = agent_feature.view(bs * A, T, -1)
        valid_agent_mask = valid_mask.any(-1).flatten()
        x_agent_tmp = self.history_encoder(agent_feature[valid_agent_mask].permute(0, 2, 1).contiguous()).max(-1)[0]
        x_agent = torch.zeros(bs * A, self.dim, device=position.device)
        x_agent[valid_agent_mask] = x_agent_tmp
        x_agent = x_agent.view(bs, A, self.dim)
        ego_feature = data["current_state"][:, : self.state_channel]
        x_ego = self.ego_state_emb(ego_feature)
        x_agent[:, 0] = x_ego
        return x_agent + self.type_emb(category)


class MapEncoder(nn.Module):
    def __init__(self, polygon_channel=6, dim=64):
        super().__init__()
        self.point_mlp = build_mlp(polygon_channel, [dim, dim])

    def forward(self, data):
        feat = self.point_mlp(data["map"]["point_feature"])  # [bs, M, P, dim]
        valid = data["map"]["valid_mask"]
        feat = feat.masked_fill(~valid[..., None], float("-inf")).max(dim=2)[0]
        return torch.where(valid.any(-1)[..., None], feat, torch.zeros_like(feat))


class TrajectoryDecoder(nn.Module):
    def __init__(self, embed_dim, num_modes, future_steps, out_channels):
        super().__init__()
        self.embed_dim, self.num_modes, self.future_steps, self.out_channels = embed_dim, num_modes, future_steps, out_channels
        self.multimodal_proj = nn.Linear(embed_dim, num_modes * embed_dim)
        hidden = 2 * embed_dim
        self.loc = nn.Sequential(nn.Linear(embed_dim, hidden), nn.LayerNorm(hidden), nn.ReLU(inplace=True),
                                 nn.Linear(hidden, future_steps * out_channels))
        self.pi = nn.Sequential(nn.Linear(embed_dim, hidden), nn.LayerNorm(hidden), nn.ReLU(inplace=True), nn.Linear(hidden, 1))

    def forward(self, x):
        x = self.multimodal_proj(x).view(-1, self.num_modes, self.embed_dim)
        loc = self.loc(x).view(-1, self.num_modes, self.future_steps, self.out_channels)
        return loc, self.pi(x).squeeze(-1)


class PlanningModel(nn.Module):
    def __init__(self, dim=64, history_steps=21, future_steps=16, encoder_depth=2, num_heads=4, num_modes=6):
        super().__init__()
        self.dim, self.history_steps, self.future_steps = dim, history_steps, future_steps
        self.pos_emb = build_mlp(4, [dim] * 2)
        self.agent_encoder = AgentEncoder(dim=dim, hist_steps=history_steps)
        self.map_encoder = MapEncoder(dim=dim)
        self.encoder_blocks = nn.ModuleList(TransformerEncoderLayer(dim=dim, num_heads=num_heads) for _ in range(encoder_depth))
        self.norm = nn.LayerNorm(dim)
        self.trajectory_decoder = TrajectoryDecoder(embed_dim=dim, num_modes=num_modes, future_steps=future_steps, out_channels=4)
        self.agent_predictor = build_mlp(dim, [dim * 2, future_steps * 2], norm="ln")

    def forward(self, data):
        agent_pos = data["agent"]["position"][:, :, self.history_steps - 1]
        agent_heading = data["agent"]["heading"][:, :, self.history_steps - 1]
        agent_mask = data["agent"]["valid_mask"][:, :, : self.history_steps]
        polygon_center = data["map"]["polygon_center"]
        polygon_mask = data["map"]["valid_mask"]
        bs, A = agent_pos.shape[0:2]
        position = torch.cat([agent_pos, polygon_center[..., :2]], dim=1)
        angle = torch.cat([agent_heading, polygon_center[..., 2]], dim=1)
        pos = torch.cat([position, torch.stack([angle.cos(), angle.sin()], dim=-1)], dim=-1)
        pos_embed = self.pos_emb(pos)
        agent_key_padding = ~(agent_mask.any(-1))
        polygon_key_padding = ~(polygon_mask.any(-1))
        key_padding_mask = torch.cat([agent_key_padding, polygon_key_padding], dim=-1)
        x_agent = self.agent_encoder(data)
        x_polygon = self.map_encoder(data)
        x = torch.cat([x_agent, x_polygon], dim=1) + pos_embed
        for blk in self.encoder_blocks:
            x = blk(x, key_padding_mask=key_padding_mask)
        x = self.norm(x)
        trajectory, probability = self.trajectory_decoder(x[:, 0])
        prediction = self.agent_predictor(x[:, 1:A]).view(bs, -1, self.future_steps, 2)
        return {"trajectory": trajectory, "probability": probability, "prediction": prediction}


def make_batch(bs=3, A=6, M=8, P=10, T=21, F_=16):
    agent_valid = torch.rand(bs, A, T + F_) < 0.85
    agent_valid[:, 0] = True  # ego always valid
    agent_valid[1, 3:] = False  # scene 1 has only 3 agents (padding)
    poly_valid = torch.rand(bs, M, P) < 0.9
    poly_valid[2, 5:] = False  # scene 2 has only 5 polygons (padding)
    return {
        "agent": {"position": torch.randn(bs, A, T + F_, 2), "heading": torch.randn(bs, A, T + F_),
                  "velocity": torch.randn(bs, A, T + F_, 2), "shape": torch.rand(bs, A, T + F_, 2),
                  "category": torch.randint(0, 4, (bs, A)), "valid_mask": agent_valid, "target": torch.randn(bs, A, F_, 3)},
        "map": {"polygon_center": torch.randn(bs, M, 3), "point_feature": torch.randn(bs, M, P, 6), "valid_mask": poly_valid},
        "current_state": torch.randn(bs, 7),
    }


def compute_objectives(res, data):
    trajectory, probability, prediction = res["trajectory"], res["probability"], res["prediction"]
    targets = data["agent"]["target"]
    valid_mask = data["agent"]["valid_mask"][:, :, -trajectory.shape[-2]:]
    ego_target_pos, ego_target_heading = targets[:, 0, :, :2], targets[:, 0, :, 2]
    ego_target = torch.cat([ego_target_pos, torch.stack([ego_target_heading.cos(), ego_target_heading.sin()], dim=-1)], dim=-1)
    agent_target, agent_mask = targets[:, 1:], valid_mask[:, 1:]
    ade = torch.norm(trajectory[..., :2] - ego_target[:, None, :, :2], dim=-1)
    best_mode = torch.argmin(ade.sum(-1), dim=-1)
    best_traj = trajectory[torch.arange(trajectory.shape[0]), best_mode]
    ego_reg_loss = F.smooth_l1_loss(best_traj, ego_target)
    ego_cls_loss = F.cross_entropy(probability, best_mode.detach())
    agent_reg_loss = F.smooth_l1_loss(prediction[agent_mask], agent_target[agent_mask][:, :2])
    return ego_reg_loss + ego_cls_loss + agent_reg_loss


if __name__ == "__main__":
    torch.manual_seed(0)
    data = make_batch()
    model = PlanningModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for step in range(2):
        loss = compute_objectives(model(data), data)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        out = model(data)
    print("train loss %.4f eval traj norm %.4f" % (loss.item(), out["trajectory"].norm().item()))
