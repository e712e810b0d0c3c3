# vita-epfl/UniTraj#6: AutoBot's road_segment_mask (key_padding_mask over map polylines) can be all True for a
# scene with no valid road segment, so the decoder's map attention has no key left and returns NaN.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class MapEncoderPts(nn.Module):
    def __init__(self, d_k, map_attr=2, dropout=0.0):
        super().__init__()
        self.d_k, self.map_attr = d_k, map_attr
        self.road_pts_lin = nn.Sequential(nn.Linear(map_attr, d_k))
        self.road_pts_attn_layer = nn.MultiheadAttention(d_k, num_heads=2, dropout=dropout)
        self.norm1 = nn.LayerNorm(d_k, eps=1e-5)
        self.norm2 = nn.LayerNorm(d_k, eps=1e-5)
        self.map_feats = nn.Sequential(nn.Linear(d_k, d_k), nn.ReLU(), nn.Linear(d_k, d_k))

    def get_road_pts_mask(self, roads):
        road_segment_mask = torch.sum(roads[:, :, :, -1], dim=2) == 0
        if FIXED:
            road_segment_mask[torch.all(road_segment_mask, dim=-1), 0] = False
        road_pts_mask = (1.0 - roads[:, :, :, -1]).type(torch.BoolTensor).to(roads.device).view(-1, roads.shape[2])
        road_pts_mask = road_pts_mask.masked_fill((road_pts_mask.sum(-1) == roads.shape[2]).unsqueeze(-1), False)  # Ensures no NaNs due to empty rows.
        return road_segment_mask, road_pts_mask

    def forward(self, roads, agents_emb):
        B, S, P = roads.shape[:3]
        road_segment_mask, road_pts_mask = self.get_road_pts_mask(roads)
        road_pts_feats = self.road_pts_lin(roads[:, :, :, :self.map_attr]).view(B * S, P, -1).permute(1, 0, 2)
        agents_emb = agents_emb[-1].unsqueeze(1).repeat(1, S, 1).view(-1, self.d_k).unsqueeze(0)
        road_seg_emb = self.road_pts_attn_layer(query=agents_emb, key=road_pts_feats, value=road_pts_feats,
                                                key_padding_mask=road_pts_mask)[0]
        road_seg_emb = self.norm1(road_seg_emb)
        road_seg_emb2 = self.norm2(road_seg_emb + self.map_feats(road_seg_emb))
        return road_seg_emb2.view(B, S, -1).permute(1, 0, 2), road_segment_mask


class AutoBotEgo(nn.Module):
    def __init__(self, d_k=16, c=2, T=4, k_attr=2, L_dec=1):
        super().__init__()
        self.d_k, self.c, self.T, self.L_dec = d_k, c, T, L_dec
        self.agents_dynamic_encoder = nn.Linear(k_attr, d_k)
        self.temporal_attn_layer = nn.TransformerEncoderLayer(d_k, nhead=2, dim_feedforward=32, dropout=0.0)
        self.map_encoder = MapEncoderPts(d_k)
        self.Q = nn.Parameter(torch.randn(T, 1, c, d_k))
        self.map_attn_layers = nn.MultiheadAttention(d_k, num_heads=2, dropout=0.0)
        self.tx_decoder = nn.ModuleList([nn.TransformerDecoderLayer(d_k, nhead=2, dim_feedforward=32, dropout=0.0)
                                         for _ in range(L_dec)])
        self.output_model = nn.Linear(d_k, 5)
        self.P = nn.Parameter(torch.randn(c, 1, d_k))
        self.mode_map_attn = nn.MultiheadAttention(d_k, num_heads=2)
        self.prob_predictor = nn.Linear(d_k, 1)

    def generate_decoder_mask(self, seq_len, device):
        return torch.triu(torch.ones((seq_len, seq_len), device=device), diagonal=1).bool()

    def forward(self, ego_in, roads):
        B = ego_in.size(0)
        env_masks = (1.0 - ego_in[:, :, -1]).to(torch.bool)  # [B, T_obs], True = missing timestep
        ego_emb = self.agents_dynamic_encoder(ego_in[:, :, :-1]).permute(1, 0, 2)  # [T_obs, B, d_k]
        ego_soctemp_emb = self.temporal_attn_layer(ego_emb, src_key_padding_mask=env_masks)

        orig_map_features, orig_road_segs_masks = self.map_encoder(roads, ego_soctemp_emb)
        map_features = orig_map_features.unsqueeze(2).repeat(1, 1, self.c, 1).view(-1, B * self.c, self.d_k)
        road_segs_masks = orig_road_segs_masks.unsqueeze(1).repeat(1, self.c, 1).view(B * self.c, -1)
        context = ego_soctemp_emb.unsqueeze(2).repeat(1, 1, self.c, 1).view(-1, B * self.c, self.d_k)
        env_masks = env_masks.unsqueeze(1).repeat(1, self.c, 1).view(B * self.c, -1)

        out_seq = self.Q.repeat(1, B, 1, 1).view(self.T, B * self.c, -1)
        time_masks = self.generate_decoder_mask(seq_len=self.T, device=ego_in.device)
        for d in range(self.L_dec):
            ego_dec_emb_map = self.map_attn_layers(query=out_seq, key=map_features, value=map_features,
                                                   key_padding_mask=road_segs_masks)[0]
            out_seq = out_seq + ego_dec_emb_map
            out_seq = self.tx_decoder[d](out_seq, context, tgt_mask=time_masks, memory_key_padding_mask=env_masks)
        out_dists = self.output_model(out_seq).reshape(self.T, B, self.c, -1).permute(2, 0, 1, 3)

        mode_params_emb = self.P.repeat(1, B, 1)
        mode_params_emb = self.mode_map_attn(query=mode_params_emb, key=orig_map_features, value=orig_map_features,
                                             key_padding_mask=orig_road_segs_masks)[0] + mode_params_emb
        mode_probs = F.softmax(self.prob_predictor(mode_params_emb).squeeze(-1), dim=0).transpose(0, 1)
        return out_dists, mode_probs


B, T_obs, S, P = 2, 5, 3, 4
ego_in = torch.cat([torch.randn(B, T_obs, 2), torch.ones(B, T_obs, 1)], dim=-1)
ego_in[1, :2, -1] = 0.  # second ego observed for the last 3 steps only
roads = torch.cat([torch.randn(B, S, P, 2), torch.ones(B, S, P, 1)], dim=-1)
roads[0, 2, :, -1] = 0.  # scene 0: last polyline is padding
roads[1, :, :, -1] = 0.  # scene 1: agent in an open area, no road segment at all
roads[..., :2] *= roads[..., 2:]

model = AutoBotEgo().eval()
with torch.no_grad():
    out_dists, mode_probs = model(ego_in, roads)
n_nan = torch.isnan(out_dists).sum().item() + torch.isnan(mode_probs).sum().item()
print(f"fixed={FIXED} NaNs in predictions: {n_nan}; scene-1 mode probs: {mode_probs[1].tolist()}")
