# Citation: huggingface/lerobot src/lerobot/policies/act/modeling_act.py (ACT.forward VAE branch: key_padding_mask =
#   cat([cls_joint_is_pad, batch["action_is_pad"]]); ACTEncoderLayer / ACTDecoderLayer over seq-first
#   nn.MultiheadAttention; ACTPolicy.forward l1 loss weighted by ~action_is_pad).
# Masking: the VAE encoder sees [cls, joint state, action chunk] where chunk steps past the episode end are padding;
#   the bool key_padding_mask (True = pad) blocks them as keys, the cls latent summarises only real actions; the
#   DETR-style decoder's action queries cross-attend to [latent, state, image features] (all real, no mask) and attend
#   each other bidirectionally; padded action rows are dropped from the loss.
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def create_sinusoidal_pos_embedding(num_positions, dimension):
    def get_position_angle_vec(position):
        return [position / math.pow(10000, 2 * (hid_j // 2) / dimension) for hid_j in range(dimension)]
    sinusoid_table = torch.tensor([get_position_angle_vec(p) for p in range(num_positions)]).float()
    sinusoid_table[:, 0::2] = torch.sin(sinusoid_table[:, 0::2])
    sinusoid_table[:, 1::2] = torch.cos(sinusoid_table[:, 1::2])
    return sinusoid_table


class ACTEncoderLayer(nn.Module):
    def __init__(self, dim, n_heads, ff):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, n_heads, dropout=0.0)
        self.linear1, self.linear2 = nn.Linear(dim, ff), nn.Linear(ff, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.pre_norm = False

    def forward(self, x, pos_embed=None, key_padding_mask=None):
        skip = x
        if self.pre_norm:
            x = self.norm1(x)
        q = k = x if pos_embed is None else x + pos_embed
        x = self.self_attn(q, k, value=x, key_padding_mask=key_padding_mask)
        x = x[0]
        x = skip + x
        if self.pre_norm:
            skip = x
            x = self.norm2(x)
        else:
            x = self.norm1(x)
            skip = x
        x = self.linear2(F.relu(self.linear1(x)))
        x = skip + x
        if not self.pre_norm:
            x = self.norm2(x)
        return x


class ACTEncoder(nn.Module):
    def __init__(self, dim, n_heads, ff, n_layers):
        super().__init__()
        self.layers = nn.ModuleList([ACTEncoderLayer(dim, n_heads, ff) for _ in range(n_layers)])

    def forward(self, x, pos_embed=None, key_padding_mask=None):
        for layer in self.layers:
            x = layer(x, pos_embed=pos_embed, key_padding_mask=key_padding_mask)
        return x


class ACTDecoderLayer(nn.Module):
    def __init__(self, dim, n_heads, ff):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, n_heads)
        self.multihead_attn = nn.MultiheadAttention(dim, n_heads)
        self.linear1, self.linear2 = nn.Linear(dim, ff), nn.Linear(ff, dim)
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)

    def maybe_add_pos_embed(self, tensor, pos_embed):
        return tensor if pos_embed is None else tensor + pos_embed

    def forward(self, x, encoder_out, decoder_pos_embed=None, encoder_pos_embed=None):
        skip = x
        q = k = self.maybe_add_pos_embed(x, decoder_pos_embed)
        x = self.self_attn(q, k, value=x)[0]
        x = self.norm1(skip + x)
        skip = x
        x = self.multihead_attn(query=self.maybe_add_pos_embed(x, decoder_pos_embed),
                                key=self.maybe_add_pos_embed(encoder_out, encoder_pos_embed), value=encoder_out)[0]
        x = self.norm2(skip + x)
        skip = x
        x = self.linear2(F.relu(self.linear1(x)))
        return self.norm3(skip + x)


class ACT(nn.Module):
    def __init__(self, state_dim=6, action_dim=6, chunk_size=8, dim=32, latent_dim=8, n_img=9):
        super().__init__()
        self.chunk_size, self.latent_dim = chunk_size, latent_dim
        self.vae_encoder = ACTEncoder(dim, 4, 64, 2)
        self.vae_encoder_cls_embed = nn.Embedding(1, dim)
        self.vae_encoder_robot_state_input_proj = nn.Linear(state_dim, dim)
        self.vae_encoder_action_input_proj = nn.Linear(action_dim, dim)
        self.vae_encoder_latent_output_proj = nn.Linear(dim, latent_dim * 2)
        self.register_buffer("vae_encoder_pos_enc", create_sinusoidal_pos_embedding(1 + 1 + chunk_size, dim)[None])
        self.encoder = ACTEncoder(dim, 4, 64, 2)
        self.decoder_layers = nn.ModuleList([ACTDecoderLayer(dim, 4, 64)])
        self.encoder_robot_state_input_proj = nn.Linear(state_dim, dim)
        self.encoder_latent_input_proj = nn.Linear(latent_dim, dim)
        self.encoder_img_feat_input_proj = nn.Linear(16, dim)
        self.encoder_1d_feature_pos_embed = nn.Embedding(2, dim)
        self.img_pos = nn.Parameter(torch.randn(n_img, 1, dim) * 0.02)
        self.decoder_pos_embed = nn.Embedding(chunk_size, dim)
        self.action_head = nn.Linear(dim, action_dim)

    def forward(self, batch):
        batch_size = batch["observation.state"].shape[0]
        cls_embed = self.vae_encoder_cls_embed.weight[None].expand(batch_size, 1, -1)
        robot_state_embed = self.vae_encoder_robot_state_input_proj(batch["observation.state"]).unsqueeze(1)
        action_embed = self.vae_encoder_action_input_proj(batch["action"])
        vae_encoder_input = torch.cat([cls_embed, robot_state_embed, action_embed], axis=1)
        pos_embed = self.vae_encoder_pos_enc.clone().detach()
        # False means not a padding token.
        cls_joint_is_pad = torch.full((batch_size, 2), False)
        key_padding_mask = torch.cat([cls_joint_is_pad, batch["action_is_pad"]], axis=1)
        cls_token_out = self.vae_encoder(vae_encoder_input.permute(1, 0, 2), pos_embed=pos_embed.permute(1, 0, 2),
                                         key_padding_mask=key_padding_mask)[0]
        latent_pdf_params = self.vae_encoder_latent_output_proj(cls_token_out)
        mu = latent_pdf_params[:, :self.latent_dim]
        log_sigma_x2 = latent_pdf_params[:, self.latent_dim:]
        latent_sample = mu + log_sigma_x2.div(2).exp() * torch.randn_like(mu)

        encoder_in_tokens = [self.encoder_latent_input_proj(latent_sample),
                             self.encoder_robot_state_input_proj(batch["observation.state"])]
        encoder_in_pos_embed = list(self.encoder_1d_feature_pos_embed.weight.unsqueeze(1))
        encoder_in_tokens = torch.stack(encoder_in_tokens, axis=0)
        encoder_in_pos_embed = torch.stack(encoder_in_pos_embed, axis=0)
        cam_features = self.encoder_img_feat_input_proj(batch["image_features"]).permute(1, 0, 2)
        encoder_in_tokens = torch.cat([encoder_in_tokens, cam_features], axis=0)
        encoder_in_pos_embed = torch.cat([encoder_in_pos_embed, self.img_pos], axis=0)
        encoder_out = self.encoder(encoder_in_tokens, pos_embed=encoder_in_pos_embed)
        decoder_in = torch.zeros((self.chunk_size, batch_size, encoder_in_tokens.shape[-1]))
        x = decoder_in
        for layer in self.decoder_layers:
            x = layer(x, encoder_out, encoder_pos_embed=encoder_in_pos_embed,
                      decoder_pos_embed=self.decoder_pos_embed.weight.unsqueeze(1))
        x = x.transpose(0, 1)
        return self.action_head(x), (mu, log_sigma_x2)


model = ACT()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
B = 3
batch = {
    "observation.state": torch.randn(B, 6),
    "action": torch.randn(B, 8, 6),
    "action_is_pad": torch.tensor([[False] * 8, [False] * 5 + [True] * 3, [False] * 2 + [True] * 6]),
    "image_features": torch.randn(B, 9, 16),
}
actions_hat, (mu_hat, log_sigma_x2_hat) = model(batch)
l1_loss = (F.l1_loss(batch["action"], actions_hat, reduction="none") * ~batch["action_is_pad"].unsqueeze(-1)).mean()
mean_kld = (-0.5 * (1 + log_sigma_x2_hat - mu_hat.pow(2) - (log_sigma_x2_hat).exp())).sum(-1).mean()
loss = l1_loss + mean_kld * 10.0
opt.zero_grad()
loss.backward()
opt.step()
print(f"l1 {l1_loss.item():.4f} kld {mean_kld.item():.4f}")
