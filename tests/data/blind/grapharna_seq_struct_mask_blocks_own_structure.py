# Citation: mjustynaPhD/GraphaRNA PR #10, commit fdc0af3 ("fix: attention mask in the transformer block was incorrect"),
#   src/grapharna/models.py, SequenceStructureModule.forward.
# Bug: the nodes of several RNA structures in one PyG batch go through one nn.TransformerEncoder; the bool mask was
#   built with 1 (= blocked for a bool attn_mask) on same-structure pairs and 0 (= allowed) elsewhere, so with more than
#   one structure in the batch every nucleotide attended only to the nucleotides of the other structures.
# Fix: start from all ones (block everything) and set the same-structure pairs to 0.
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
        if FIXED:
            attn_mask = torch.ones(x.size(0), x.size(0), device=x.device)  # Default: block all
            attn_pos = torch.where(batch[:, None] == batch[None, :])
            attn_mask[attn_pos] = 0  # Allow attention within same structure
        else:
            attn_mask = torch.zeros(x.size(0), x.size(0), device=x.device)
            attn_pos = torch.where(batch[:, None] == batch[None, :])
            if batch.sum() == 0:
                attn_mask[attn_pos] = 0
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


class Sampler:
    def __init__(self, timesteps):
        betas = torch.linspace(1e-4, 0.02, timesteps)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.sqrt_alphas_cumprod = torch.sqrt(alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = torch.sqrt(1.0 - alphas_cumprod)

    def q_sample(self, x_start, t, noise):
        a = self.sqrt_alphas_cumprod[t][:, None]
        b = self.sqrt_one_minus_alphas_cumprod[t][:, None]
        return a * x_start + b * noise


def p_losses(denoise_model, x_data, seqs, t, sampler, loss_type="huber", noise=None, mask=None):
    x_start = x_data["x"].contiguous()
    if noise is None:
        noise = torch.randn_like(x_start)
    x_noisy = sampler.q_sample(x_start=x_start, t=t, noise=noise)
    if mask is None:
        mask = torch.ones(x_start.shape[0]).bool()
    else:
        mask = mask.bool()
    x_noisy = torch.cat((x_noisy[:, :3], x_data["x"][:, 3:]), dim=1)
    x_data["x"] = x_noisy
    predicted_noise = denoise_model(x_data, seqs, t)
    noise[:, 3:] = x_start[:, 3:]
    loss = F.smooth_l1_loss(noise[mask], predicted_noise[mask])
    return loss, loss


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
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampler = Sampler(timesteps=1000)
    seqs = ["GGCUAGCUAGCC", "ACGUUCGA", "GAUCCGAUAG"]
    data = make_batch(seqs)
    model.train()
    losses = []
    for step in range(3):
        d = {"x": data["x"].clone(), "batch": data["batch"]}
        mask = d["x"][:, -1].bool()
        optimizer.zero_grad()
        t = torch.randint(0, 1000, (len(seqs),)).long()
        graphs_t = t[d["batch"]]
        loss_all, _ = p_losses(model, d, seqs, graphs_t, sampler=sampler, loss_type="huber", mask=mask)
        loss_all.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss_all.item())
    print("fixed" if FIXED else "buggy", "losses", " ".join(f"{v:.5f}" for v in losses))


if __name__ == "__main__":
    main()
