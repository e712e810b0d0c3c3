# Citation: mjustynaPhD/GraphaRNA commit 15ce045 ("update: bug fixed in single sample generation"),
#   src/grapharna/models.py, SequenceStructureModule.forward.
# Bug: the bool mask of the sequence-structure nn.TransformerEncoder was set to 1 (= blocked) on every same-structure
#   pair; when one RNA is sampled alone (PyG batch vector all zeros) every pair is blocked and every attention row of
#   the reverse-diffusion sampling loop is fully masked (NaN or an all-zero attention output, depending on the kernel).
# Fix: when batch.sum() == 0 the same-structure pairs are set to 0 (allowed) instead.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Config(object):
    def __init__(self, dataset, dim, n_layer, cutoff_l, cutoff_g, mode, knns: int, transformer_blocks: int):
        self.dataset = dataset
        self.dim = dim
        if mode == "backbone":
            self.out_dim = 12
        else:
            self.out_dim = 15
        self.n_layer = n_layer
        self.cutoff_l = cutoff_l
        self.cutoff_g = cutoff_g
        self.knns = knns
        self.transformer_blocks = transformer_blocks


class SinusoidalPositionEmbeddings(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, time):
        device = time.device
        half_dim = self.dim // 2
        embeddings = math.log(10000) / (half_dim - 1)
        embeddings = torch.exp(torch.arange(half_dim, device=device) * -embeddings)
        embeddings = time[:, None] * embeddings[None, :]
        embeddings = torch.cat((embeddings.sin(), embeddings.cos()), dim=-1)
        return embeddings


class MLP(nn.Module):
    def __init__(self, layers):
        super().__init__()
        mods = []
        for i in range(1, len(layers)):
            mods += [nn.Linear(layers[i - 1], layers[i]), nn.SiLU()]
        self.net = nn.Sequential(*mods)

    def forward(self, x):
        return self.net(x)


class TinyRNALM(nn.Module):
    """Stands in for the frozen RiNALMo language model (giga-v1, 1280-d representation)."""

    def __init__(self, vocab=9, hidden=48):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(hidden, hidden)

    def forward(self, tokens):
        return {"representation": torch.tanh(self.mix(self.embed(tokens)))}


class SequenceModule(nn.Module):
    NT = {"A": 5, "C": 6, "G": 7, "U": 8}  # ids 0-4 are <pad> <cls> <eos> <unk> <mask>

    def __init__(self, dim, lm_dim=48):
        super(SequenceModule, self).__init__()
        self.rinalmo = TinyRNALM(hidden=lm_dim)
        self.out_embedding = nn.Linear(lm_dim, dim, bias=False)
        self.emb_act = nn.ReLU()

    def batch_tokenize(self, seqs):
        L = max(len(s) for s in seqs)
        return [[1] + [self.NT[c] for c in s] + [2] + [0] * (L - len(s)) for s in seqs]

    def forward(self, seqs, device):
        self.rinalmo.eval()
        tokens = torch.tensor(self.batch_tokenize(seqs), dtype=torch.int64, device=device)
        flat_tokens = tokens.flatten()
        nt_positions = torch.where(flat_tokens > 4)[0]
        with torch.no_grad():
            outputs = self.rinalmo(tokens)
        out = self.out_embedding(outputs["representation"])
        out = self.emb_act(out)
        out = out.reshape((-1, out.size(2)))
        return out[nt_positions]


class SequenceStructureModule(nn.Module):
    def __init__(self, dim, n_layers: int = 6, nhead: int = 8):
        super(SequenceStructureModule, self).__init__()
        self.encoder_layer = nn.TransformerEncoderLayer(d_model=dim, nhead=nhead, batch_first=True)
        self.transformer_encoder = nn.TransformerEncoder(self.encoder_layer, num_layers=n_layers, norm=nn.LayerNorm(dim))

    def forward(self, seq_emb, x_struct, batch):
        x = torch.cat((seq_emb, x_struct), dim=1)
        attn_mask = torch.zeros(x.size(0), x.size(0), device=x.device)
        attn_pos = torch.where(batch[:, None] == batch[None, :])
        if FIXED:
            if batch.sum() == 0:
                attn_mask[attn_pos] = 0
            else:
                attn_mask[attn_pos] = 1
        else:
            attn_mask[attn_pos] = 1
        out = self.transformer_encoder(x, mask=attn_mask.bool())
        return out


class PAMNet(nn.Module):
    def __init__(self, config: Config, time_dim=16):
        super(PAMNet, self).__init__()
        self.dim = config.dim
        self.time_dim = time_dim
        self.n_layer = config.n_layer
        self.atom_dim = config.out_dim - 3
        self.seq_emb_dim = config.dim
        self.blocks = config.transformer_blocks
        self.total_dim = self.dim + self.atom_dim + self.seq_emb_dim + self.time_dim
        self.init_linear = MLP([3, self.dim])
        self.sequence_module = SequenceModule(self.seq_emb_dim)
        self.seq_struct_module = SequenceStructureModule(self.seq_emb_dim + self.dim, n_layers=self.blocks, nhead=8)
        self.time_mlp = nn.Sequential(
            SinusoidalPositionEmbeddings(self.dim),
            nn.Linear(self.dim, self.time_dim),
            nn.GELU(),
            nn.Linear(self.time_dim, self.time_dim),
        )
        # the global / local geometric message passing layers (torch_geometric) are per-node MLPs here
        self.global_layer = nn.ModuleList([MLP([self.total_dim, self.total_dim]) for _ in range(config.n_layer)])
        self.local_layer = nn.ModuleList([MLP([self.total_dim, self.total_dim]) for _ in range(config.n_layer)])
        self.att_g = nn.ModuleList([nn.Linear(self.total_dim, 1) for _ in range(config.n_layer)])
        self.att_l = nn.ModuleList([nn.Linear(self.total_dim, 1) for _ in range(config.n_layer)])
        self.struct_emb = nn.Linear(2 * self.total_dim, config.dim)
        self.out_linear = nn.Linear(self.seq_emb_dim + self.dim + self.total_dim, config.out_dim)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, data, seqs, t=None):
        x_raw = data["x"].contiguous()
        batch = data["batch"]
        x = x_raw[:, 3:]
        seq_emb = self.sequence_module(seqs, x.device)
        seq_x = torch.cat((x, seq_emb), dim=1)
        time_emb = self.time_mlp(t)
        pos = x_raw[:, :3].contiguous()
        x_pos = self.init_linear(pos)
        x = torch.cat([x_pos, seq_x, time_emb], dim=1)

        out_global, out_local, att_score_global, att_score_local = [], [], [], []
        for layer in range(self.n_layer):
            out_g = self.global_layer[layer](x)
            x = x + out_g
            out_global.append(out_g.unsqueeze(0))
            att_score_global.append(self.att_g[layer](out_g).unsqueeze(0))
            out_l = self.local_layer[layer](x)
            x = x + out_l
            out_local.append(out_l.unsqueeze(0))
            att_score_local.append(self.att_l[layer](out_l).unsqueeze(0))
        att_score = torch.cat((torch.cat(att_score_global, 0), torch.cat(att_score_local, 0)), -1)
        att_score = F.leaky_relu(att_score, 0.2)
        att_weight = self.softmax(att_score)
        out = torch.cat((torch.cat(out_global, 0), torch.cat(out_local, 0)), -1)
        out = out * att_weight.repeat_interleave(self.total_dim, dim=-1)
        out = out.sum(dim=0)
        out = self.struct_emb(out)
        out = self.seq_struct_module(seq_emb, out, batch)
        out = torch.cat((x, out), dim=1)
        out = self.out_linear(out)
        return out


def linear_beta_schedule(timesteps):
    beta_start = 0.0001
    beta_end = 0.02
    return torch.linspace(beta_start, beta_end, timesteps)


class Sampler():
    def __init__(self, timesteps: int, channels: int = 3):
        self.timesteps = timesteps
        self.channels = channels
        self.betas = linear_beta_schedule(timesteps=timesteps)
        alphas = 1. - self.betas
        alphas_cumprod = torch.cumprod(alphas, axis=0)
        alphas_cumprod_prev = F.pad(alphas_cumprod[:-1], (1, 0), value=1.0)
        self.sqrt_recip_alphas = torch.sqrt(1.0 / alphas)
        self.sqrt_alphas_cumprod = torch.sqrt(alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = torch.sqrt(1. - alphas_cumprod)
        self.posterior_variance = self.betas * (1. - alphas_cumprod_prev) / (1. - alphas_cumprod)

    @torch.no_grad()
    def p_sample(self, model, seqs, x_raw, t, t_index, coord_mask, atoms_mask):
        x = x_raw["x"] * coord_mask
        betas_t = self.extract(self.betas, t, x.shape)
        sqrt_one_minus_alphas_cumprod_t = self.extract(self.sqrt_one_minus_alphas_cumprod, t, x.shape)
        sqrt_recip_alphas_t = self.extract(self.sqrt_recip_alphas, t, x.shape)
        model_mean = sqrt_recip_alphas_t * (
            x - betas_t * model(x_raw, seqs, t) * coord_mask / sqrt_one_minus_alphas_cumprod_t
        )
        if t_index == 0:
            x_raw["x"] = model_mean * coord_mask + x_raw["x"] * atoms_mask
            return x_raw["x"]
        else:
            posterior_variance_t = self.extract(self.posterior_variance, t, x.shape)
            noise = torch.randn_like(x)
            out = model_mean + torch.sqrt(posterior_variance_t) * noise
            x_raw["x"] = out * coord_mask + x_raw["x"] * atoms_mask
            return x_raw["x"]

    @torch.no_grad()
    def p_sample_loop(self, model, seqs, shape, context_mols):
        b = shape[0]
        coord_mask = torch.ones_like(context_mols["x"])
        coord_mask[:, 3:] = 0
        atoms_mask = 1 - coord_mask
        noise = torch.rand_like(context_mols["x"])
        denoised = []
        context_mols["x"] = noise * coord_mask + context_mols["x"] * atoms_mask
        for i in reversed(range(0, self.timesteps)):
            context_mols["x"] = self.p_sample(model, seqs, context_mols, torch.full((b,), i, dtype=torch.long), i,
                                              coord_mask, atoms_mask)
        denoised.append({"x": context_mols["x"].clone(), "batch": context_mols["batch"]})
        return denoised

    @torch.no_grad()
    def sample(self, model, seqs, context_mols):
        return self.p_sample_loop(model, seqs, shape=context_mols["x"].shape, context_mols=context_mols)

    def extract(self, a, t, x_shape):
        batch_size = t.shape[0]
        out = a.gather(-1, t.cpu())
        return out.reshape(batch_size, *((1,) * (len(x_shape) - 1))).to(t.device)


def make_batch(seqs):
    xs, batch = [], []
    for gi, s in enumerate(seqs):
        n = len(s)
        coords = torch.cumsum(torch.randn(n, 3) * 0.3, dim=0)
        feats = torch.zeros(n, 12)
        feats[torch.arange(n), torch.randint(0, 4, (n,))] = 1.0   # atom type one-hot
        feats[torch.arange(n), 4 + torch.tensor(["AGCU".index(c) for c in s])] = 1.0  # residue type
        feats[:, -1] = 1.0  # coordinates to be denoised
        xs.append(torch.cat([coords, feats], dim=1))
        batch += [gi] * n
    return {"x": torch.cat(xs, 0), "batch": torch.tensor(batch)}


def main():
    torch.manual_seed(0)
    config = Config("RNA-PDB", dim=32, n_layer=2, cutoff_l=0.5, cutoff_g=1.6, mode="coarse-grain", knns=20,
                    transformer_blocks=2)
    model = PAMNet(config)
    model.eval()
    sampler = Sampler(timesteps=8)
    seqs = ["GGCUAGCUAGCCAUGC"]  # one RNA sampled on its own: data.batch is all zeros
    data = make_batch(seqs)
    samples = sampler.sample(model, seqs, data)[-1]
    coords = samples["x"][:, :3]
    print("fixed" if FIXED else "buggy", "sampled coords norm", "%.5f" % coords.norm().item(),
          "nan:", bool(torch.isnan(coords).any()))


if __name__ == "__main__":
    main()
