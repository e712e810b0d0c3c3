# Follows real-stanford/diffusion_policy diffusion_policy/model/diffusion/transformer_for_diffusion.py (TransformerForDiffusion,
# causal_attn=True, time_as_cond, obs_as_cond): float tgt_mask (0 / -inf causal) and memory_mask t >= s-1 over [time token, obs...],
# so action token t reads the diffusion-time token and obs 0..t; horizon (10 queries) > cond length (3 keys). Checked by a per-query loop.
import math
import torch
import torch.nn as nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
input_dim, cond_dim, horizon, n_obs_steps, n_emb, n_head, n_layer = 4, 6, 10, 2, 32, 4, 2
T, T_cond = horizon, 1 + n_obs_steps


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        half = self.dim // 2
        emb = torch.exp(torch.arange(half) * -(math.log(10000) / (half - 1)))
        emb = x[:, None] * emb[None, :]
        return torch.cat((emb.sin(), emb.cos()), dim=-1)


class TransformerForDiffusion(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_emb = nn.Linear(input_dim, n_emb)
        self.pos_emb = nn.Parameter(0.02 * torch.randn(1, T, n_emb))
        self.time_emb = SinusoidalPosEmb(n_emb)
        self.cond_obs_emb = nn.Linear(cond_dim, n_emb)
        self.cond_pos_emb = nn.Parameter(0.02 * torch.randn(1, T_cond, n_emb))
        self.encoder = nn.Sequential(nn.Linear(n_emb, 4 * n_emb), nn.Mish(), nn.Linear(4 * n_emb, n_emb))  # n_cond_layers == 0
        layer = nn.TransformerDecoderLayer(n_emb, n_head, 4 * n_emb, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, num_layers=n_layer)
        # causal mask, exactly as the repo builds it
        mask = (torch.triu(torch.ones(T, T)) == 1).transpose(0, 1)
        mask = mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0))
        self.register_buffer("mask", mask)
        t, s = torch.meshgrid(torch.arange(T), torch.arange(T_cond), indexing="ij")
        mask = t >= (s - 1)  # add one dimension since time is the first token in cond
        mask = mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0))
        self.register_buffer("memory_mask", mask)
        self.ln_f = nn.LayerNorm(n_emb)
        self.head = nn.Linear(n_emb, input_dim)

    def embed(self, sample, timestep, cond):
        cond_embeddings = torch.cat([self.time_emb(timestep).unsqueeze(1), self.cond_obs_emb(cond)], dim=1)
        memory = self.encoder(cond_embeddings + self.cond_pos_emb[:, : cond_embeddings.shape[1]])
        x = self.input_emb(sample) + self.pos_emb[:, : sample.shape[1]]
        return x, memory

    def forward(self, sample, timestep, cond):
        x, memory = self.embed(sample, timestep, cond)
        x = self.decoder(tgt=x, memory=memory, tgt_mask=self.mask, memory_mask=self.memory_mask)
        return self.head(self.ln_f(x))


def mha_loop(mha, xq, xkv, allowed):
    """Per-query attention using only the allowed key indices."""
    Wq, Wk, Wv = mha.in_proj_weight.chunk(3)
    bq, bk, bv = mha.in_proj_bias.chunk(3)
    B, Lq, _ = xq.shape
    hd = n_emb // n_head
    q = (xq @ Wq.T + bq).view(B, Lq, n_head, hd)
    k = (xkv @ Wk.T + bk).view(B, -1, n_head, hd)
    v = (xkv @ Wv.T + bv).view(B, -1, n_head, hd)
    out = torch.zeros(B, Lq, n_head, hd)
    for i in range(Lq):
        js = allowed(i)
        s = torch.einsum("bhd,bjhd->bhj", q[:, i], k[:, js]) / math.sqrt(hd)
        out[:, i] = torch.einsum("bhj,bjhd->bhd", torch.softmax(s, -1), v[:, js])
    return mha.out_proj(out.reshape(B, Lq, n_emb))


def reference(model, sample, timestep, cond):
    x, memory = model.embed(sample, timestep, cond)
    for lyr in model.decoder.layers:
        x = x + mha_loop(lyr.self_attn, lyr.norm1(x), lyr.norm1(x), lambda i: list(range(i + 1)))
        # action t may read cond index 0 (time) and obs tokens 1..t+1 that exist
        x = x + mha_loop(lyr.multihead_attn, lyr.norm2(x), memory, lambda i: list(range(min(i + 2, T_cond))))
        x = x + lyr.linear2(torch.nn.functional.gelu(lyr.linear1(lyr.norm3(x))))
    return model.head(model.ln_f(x))


model = TransformerForDiffusion().eval()
B = 3
sample = torch.randn(B, T, input_dim)
timestep = torch.tensor([5.0, 50.0, 99.0])
cond = torch.randn(B, n_obs_steps, cond_dim)
with torch.no_grad():
    got = model(sample, timestep, cond)
    ref = reference(model, sample, timestep, cond)
    d = (got - ref).abs().max().item()
    print(f"masked nn.TransformerDecoder vs per-query loop: max diff = {d:.3e}")
    # action 0 must not depend on obs step 1 (memory index 2): perturb it
    cond2 = cond.clone()
    cond2[:, 1] += 3.0
    d0 = (model(sample, timestep, cond2)[:, 0] - got[:, 0]).abs().max().item()
    print(f"action 0 after perturbing obs step 1: max diff = {d0:.3e}")
worst = max(d, d0)
assert worst < 1e-12, worst
print(f"max difference: {worst:.3e}")
