# Citation: real-stanford/diffusion_policy diffusion_policy/model/diffusion/transformer_for_diffusion.py
#   (commit 4bf419aa5a9b25bde5cd1e332b077f45fba190c1), TransformerForDiffusion (causal_attn=True, obs_as_cond).
# Masking: action tokens use an additive float causal tgt_mask; cross-attention to the condition memory
#   [time, obs_0..obs_{To-1}] (To+1 keys, shorter than horizon) uses memory_mask t >= s-1: action t sees the
#   diffusion-time token and observations up to step t. Every row keeps >= 2 keys, so it is right.
import math
import torch
import torch.nn as nn

torch.manual_seed(0)


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        device = x.device
        half_dim = self.dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, device=device) * -emb)
        emb = x[:, None] * emb[None, :]
        emb = torch.cat((emb.sin(), emb.cos()), dim=-1)
        return emb


class TransformerForDiffusion(nn.Module):
    def __init__(self, input_dim, output_dim, horizon, n_obs_steps=None, cond_dim=0, n_layer=2, n_head=4,
                 n_emb=64, p_drop_emb=0.0, p_drop_attn=0.0, causal_attn=False, time_as_cond=True,
                 obs_as_cond=False, n_cond_layers=0):
        super().__init__()
        if n_obs_steps is None:
            n_obs_steps = horizon
        T = horizon
        T_cond = 1
        if not time_as_cond:
            T += 1
            T_cond -= 1
        obs_as_cond = cond_dim > 0
        if obs_as_cond:
            assert time_as_cond
            T_cond += n_obs_steps
        self.input_emb = nn.Linear(input_dim, n_emb)
        self.pos_emb = nn.Parameter(torch.zeros(1, T, n_emb))
        self.drop = nn.Dropout(p_drop_emb)
        self.time_emb = SinusoidalPosEmb(n_emb)
        self.cond_obs_emb = None
        if obs_as_cond:
            self.cond_obs_emb = nn.Linear(cond_dim, n_emb)
        self.cond_pos_emb = nn.Parameter(torch.zeros(1, T_cond, n_emb))
        encoder_layer = nn.TransformerEncoderLayer(d_model=n_emb, nhead=n_head, dim_feedforward=4 * n_emb,
                                                   dropout=p_drop_attn, activation='gelu', batch_first=True,
                                                   norm_first=True)
        self.encoder = nn.TransformerEncoder(encoder_layer=encoder_layer, num_layers=n_cond_layers)
        decoder_layer = nn.TransformerDecoderLayer(d_model=n_emb, nhead=n_head, dim_feedforward=4 * n_emb,
                                                   dropout=p_drop_attn, activation='gelu', batch_first=True,
                                                   norm_first=True)
        self.decoder = nn.TransformerDecoder(decoder_layer=decoder_layer, num_layers=n_layer)
        if causal_attn:
            sz = T
            mask = (torch.triu(torch.ones(sz, sz)) == 1).transpose(0, 1)
            mask = mask.float().masked_fill(mask == 0, float('-inf')).masked_fill(mask == 1, float(0.0))
            self.register_buffer("mask", mask)
            if time_as_cond and obs_as_cond:
                S = T_cond
                t, s = torch.meshgrid(torch.arange(T), torch.arange(S), indexing='ij')
                mask = t >= (s - 1)  # add one dimension since time is the first token in cond
                mask = mask.float().masked_fill(mask == 0, float('-inf')).masked_fill(mask == 1, float(0.0))
                self.register_buffer('memory_mask', mask)
            else:
                self.memory_mask = None
        else:
            self.mask = None
            self.memory_mask = None
        self.ln_f = nn.LayerNorm(n_emb)
        self.head = nn.Linear(n_emb, output_dim)
        self.obs_as_cond = obs_as_cond

    def forward(self, sample, timestep, cond=None):
        timesteps = timestep
        if torch.is_tensor(timesteps) and len(timesteps.shape) == 0:
            timesteps = timesteps[None].to(sample.device)
        timesteps = timesteps.expand(sample.shape[0])
        time_emb = self.time_emb(timesteps).unsqueeze(1)
        input_emb = self.input_emb(sample)
        cond_embeddings = time_emb
        if self.obs_as_cond:
            cond_obs_emb = self.cond_obs_emb(cond)
            cond_embeddings = torch.cat([cond_embeddings, cond_obs_emb], dim=1)
        tc = cond_embeddings.shape[1]
        x = self.drop(cond_embeddings + self.cond_pos_emb[:, :tc, :])
        x = self.encoder(x)
        memory = x
        t = input_emb.shape[1]
        x = self.drop(input_emb + self.pos_emb[:, :t, :])
        x = self.decoder(tgt=x, memory=memory, tgt_mask=self.mask, memory_mask=self.memory_mask)
        x = self.ln_f(x)
        return self.head(x)


model = TransformerForDiffusion(input_dim=7, output_dim=7, horizon=10, n_obs_steps=2, cond_dim=12,
                                causal_attn=True, n_cond_layers=1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
B = 4
actions = torch.randn(B, 10, 7)
obs = torch.randn(B, 2, 12)
t = torch.randint(0, 100, (B,))
noise = torch.randn_like(actions)
noisy = actions + 0.1 * t[:, None, None] / 100 * noise
pred = model(noisy, t, obs)
loss = nn.functional.mse_loss(pred, noise)
loss.backward()
opt.step()
print(f"loss {loss.item():.4f}")
