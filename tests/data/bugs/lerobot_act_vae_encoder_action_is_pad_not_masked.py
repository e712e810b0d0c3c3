# LeRobot ACT policy (huggingface/lerobot#279, commit 4895166): the VAE encoder over [cls, robot_state, *action_chunk]
# ran nn.MultiheadAttention with no key_padding_mask, so the cls token (-> latent mu / log_sigma) attended to the
# padded action steps past the end of the episode (batch["action_is_pad"]).
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv


@dataclass
class ACTConfig:
    input_shapes: dict = field(default_factory=lambda: {"observation.state": [6]})
    output_shapes: dict = field(default_factory=lambda: {"action": [6]})
    chunk_size: int = 12
    pre_norm: bool = False
    dim_model: int = 32
    n_heads: int = 4
    dim_feedforward: int = 64
    feedforward_activation: str = "relu"
    n_encoder_layers: int = 2
    latent_dim: int = 8
    use_vae: bool = True
    dropout: float = 0.1
    kl_weight: float = 10.0


def get_activation_fn(activation: str):
    if activation == "relu":
        return F.relu
    if activation == "gelu":
        return F.gelu
    raise RuntimeError(activation)


def create_sinusoidal_pos_embedding(num_positions: int, dimension: int) -> Tensor:
    def get_position_angle_vec(position):
        return [position / np.power(10000, 2 * (hid_j // 2) / dimension) for hid_j in range(dimension)]

    sinusoid_table = np.array([get_position_angle_vec(pos_i) for pos_i in range(num_positions)])
    sinusoid_table[:, 0::2] = np.sin(sinusoid_table[:, 0::2])
    sinusoid_table[:, 1::2] = np.cos(sinusoid_table[:, 1::2])
    return torch.from_numpy(sinusoid_table).float()


class ACTEncoderLayer(nn.Module):
    def __init__(self, config: ACTConfig):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(config.dim_model, config.n_heads, dropout=config.dropout)
        self.linear1 = nn.Linear(config.dim_model, config.dim_feedforward)
        self.dropout = nn.Dropout(config.dropout)
        self.linear2 = nn.Linear(config.dim_feedforward, config.dim_model)
        self.norm1 = nn.LayerNorm(config.dim_model)
        self.norm2 = nn.LayerNorm(config.dim_model)
        self.dropout1 = nn.Dropout(config.dropout)
        self.dropout2 = nn.Dropout(config.dropout)
        self.activation = get_activation_fn(config.feedforward_activation)
        self.pre_norm = config.pre_norm

    def forward(self, x, pos_embed: Tensor | None = None, key_padding_mask: Tensor | None = None) -> Tensor:
        skip = x
        if self.pre_norm:
            x = self.norm1(x)
        q = k = x if pos_embed is None else x + pos_embed
        if FIXED:
            x = self.self_attn(q, k, value=x, key_padding_mask=key_padding_mask)
            x = x[0]
        else:
            x = self.self_attn(q, k, value=x)[0]  # select just the output, not the attention weights
        x = skip + self.dropout1(x)
        if self.pre_norm:
            skip = x
            x = self.norm2(x)
        else:
            x = self.norm1(x)
            skip = x
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        x = skip + self.dropout2(x)
        if not self.pre_norm:
            x = self.norm2(x)
        return x


class ACTEncoder(nn.Module):
    def __init__(self, config: ACTConfig):
        super().__init__()
        self.layers = nn.ModuleList([ACTEncoderLayer(config) for _ in range(config.n_encoder_layers)])
        self.norm = nn.LayerNorm(config.dim_model) if config.pre_norm else nn.Identity()

    def forward(self, x: Tensor, pos_embed: Tensor | None = None, key_padding_mask: Tensor | None = None) -> Tensor:
        for layer in self.layers:
            if FIXED:
                x = layer(x, pos_embed=pos_embed, key_padding_mask=key_padding_mask)
            else:
                x = layer(x, pos_embed=pos_embed)
        x = self.norm(x)
        return x


class ACT(nn.Module):
    """Only the VAE-encoder half of lerobot's ACT (the part the fix touched): it produces the latent."""

    def __init__(self, config: ACTConfig):
        super().__init__()
        self.config = config
        self.use_input_state = "observation.state" in config.input_shapes
        self.vae_encoder = ACTEncoder(config)
        self.vae_encoder_cls_embed = nn.Embedding(1, config.dim_model)
        if self.use_input_state:
            self.vae_encoder_robot_state_input_proj = nn.Linear(
                config.input_shapes["observation.state"][0], config.dim_model
            )
        self.vae_encoder_action_input_proj = nn.Linear(config.output_shapes["action"][0], config.dim_model)
        self.vae_encoder_latent_output_proj = nn.Linear(config.dim_model, config.latent_dim * 2)
        num_input_token_encoder = 1 + config.chunk_size
        if self.use_input_state:
            num_input_token_encoder += 1
        self.register_buffer(
            "vae_encoder_pos_enc",
            create_sinusoidal_pos_embedding(num_input_token_encoder, config.dim_model).unsqueeze(0),
        )

    def encode_latent(self, batch: dict[str, Tensor]):
        batch_size = batch["observation.state"].shape[0]
        cls_embed = self.vae_encoder_cls_embed.weight.unsqueeze(0).expand(batch_size, 1, -1)  # (B, 1, D)
        if self.use_input_state:
            robot_state_embed = self.vae_encoder_robot_state_input_proj(batch["observation.state"])
            robot_state_embed = robot_state_embed.unsqueeze(1)  # (B, 1, D)
        action_embed = self.vae_encoder_action_input_proj(batch["action"])  # (B, S, D)
        if self.use_input_state:
            vae_encoder_input = [cls_embed, robot_state_embed, action_embed]  # (B, S+2, D)
        else:
            vae_encoder_input = [cls_embed, action_embed]
        vae_encoder_input = torch.cat(vae_encoder_input, axis=1)
        S = vae_encoder_input.shape[1]
        # [:, :S] only so the one-sample reference below can drop the padded steps (S is the full length in the batch)
        pos_embed = self.vae_encoder_pos_enc.clone().detach()[:, :S]  # (1, S+2, D)

        key_padding_mask = None
        if FIXED:
            # Prepare key padding mask for the transformer encoder. We have 1 or 2 extra tokens at the start of the
            # sequence depending whether we use the input states or not (cls and robot state)
            # False means not a padding token.
            cls_joint_is_pad = torch.full(
                (batch_size, 2 if self.use_input_state else 1),
                False,
                device=batch["observation.state"].device,
            )
            key_padding_mask = torch.cat([cls_joint_is_pad, batch["action_is_pad"]], axis=1)  # (bs, seq+1 or 2)

        cls_token_out = self.vae_encoder(
            vae_encoder_input.permute(1, 0, 2),
            pos_embed=pos_embed.permute(1, 0, 2),
            key_padding_mask=key_padding_mask,
        )[0]  # select the class token, with shape (B, D)
        latent_pdf_params = self.vae_encoder_latent_output_proj(cls_token_out)
        mu = latent_pdf_params[:, : self.config.latent_dim]
        log_sigma_x2 = latent_pdf_params[:, self.config.latent_dim :]
        return mu, log_sigma_x2


def main():
    torch.manual_seed(0)
    config = ACTConfig()
    model = ACT(config).eval()  # dropout off so the comparison is exact

    # Two training samples; the second sits 5 steps before the end of its episode, so LeRobotDataset clamps the
    # action query indices to the last frame and flags the rest as padding in "action_is_pad".
    B, S, A = 2, config.chunk_size, config.output_shapes["action"][0]
    actions = torch.randn(B, S, A)
    n_real = [S, 5]
    action_is_pad = torch.zeros(B, S, dtype=torch.bool)
    for b, n in enumerate(n_real):
        actions[b, n:] = actions[b, n - 1]  # clamped copies of the final action
        action_is_pad[b, n:] = True
    batch = {"observation.state": torch.randn(B, 6), "action": actions, "action_is_pad": action_is_pad}

    with torch.no_grad():
        mu, log_sigma_x2 = model.encode_latent(batch)
        kld = (-0.5 * (1 + log_sigma_x2 - mu.pow(2) - (log_sigma_x2).exp())).sum(-1).mean()
        # Reference: each sample alone, with only its real (in-episode) actions.
        worst = 0.0
        for b, n in enumerate(n_real):
            one = {
                "observation.state": batch["observation.state"][b : b + 1],
                "action": actions[b : b + 1, :n],
                "action_is_pad": action_is_pad[b : b + 1, :n],
            }
            mu_ref, _ = model.encode_latent(one)
            worst = max(worst, (mu[b] - mu_ref[0]).abs().max().item())
    print(f"kld_loss={kld.item():.6f}")
    print(f"max |mu(padded chunk) - mu(real actions only)| = {worst:.6f}")


if __name__ == "__main__":
    main()
