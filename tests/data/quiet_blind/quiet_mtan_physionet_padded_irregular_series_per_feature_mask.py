# Citation: reml-lab/mTAN @670f2b78a7df279ece5cb204ac0097531cd59b23: src/models.py (multiTimeAttention,
#   enc_mtan_rnn, dec_mtan_rnn, create_classifier), src/utils.py (variable_time_collate_fn, normalize_masked_data,
#   log_normal_pdf, normal_kl, compute_losses, mean_squared_error), src/tan_classification.py (training step).
# mTAND: multi-time attention networks for irregularly sampled clinical time series (PhysioNet). Records of
# different numbers of observation times are zero-padded at the end of the time axis by variable_time_collate_fn,
# which stacks (values, observed_mask, tt) into one (B, T, 2D + 1) tensor; padded times get tt = 0, values 0 and
# mask 0. The encoder's multiTimeAttention lets a fixed grid of reference times query the observation times, one
# softmax per feature channel: scores (B, h, Q, T) are repeated over the 2D value channels and
# `masked_fill(mask.unsqueeze(-3) == 0, -1e9)` removes, per channel, every time that channel was not observed
# (padded times included). The decoder attends from the (padded) observation times to the reference grid, which
# needs no mask; padded output times are dropped by observed_mask in the loss.
# Self-check: each record sliced to its own length and run alone gives the same latent (qz0_mean, qz0_logvar),
# class logits, reconstructions at its real times, and per-record log-likelihood / KL as the padded batch.
import math
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
np.random.seed(0)


# ---- src/models.py ----
class create_classifier(nn.Module):

    def __init__(self, latent_dim, nhidden=16, N=2):
        super(create_classifier, self).__init__()
        self.gru_rnn = nn.GRU(latent_dim, nhidden, batch_first=True)
        self.classifier = nn.Sequential(
            nn.Linear(nhidden, 300),
            nn.ReLU(),
            nn.Linear(300, 300),
            nn.ReLU(),
            nn.Linear(300, N))

    def forward(self, z):
        _, out = self.gru_rnn(z)
        return self.classifier(out.squeeze(0))


class multiTimeAttention(nn.Module):

    def __init__(self, input_dim, nhidden=16,
                 embed_time=16, num_heads=1):
        super(multiTimeAttention, self).__init__()
        assert embed_time % num_heads == 0
        self.embed_time = embed_time
        self.embed_time_k = embed_time // num_heads
        self.h = num_heads
        self.dim = input_dim
        self.nhidden = nhidden
        self.linears = nn.ModuleList([nn.Linear(embed_time, embed_time),
                                      nn.Linear(embed_time, embed_time),
                                      nn.Linear(input_dim*num_heads, nhidden)])

    def attention(self, query, key, value, mask=None, dropout=None):
        "Compute 'Scaled Dot Product Attention'"
        dim = value.size(-1)
        d_k = query.size(-1)
        scores = torch.matmul(query, key.transpose(-2, -1)) \
                 / math.sqrt(d_k)
        scores = scores.unsqueeze(-1).repeat_interleave(dim, dim=-1)
        if mask is not None:
            scores = scores.masked_fill(mask.unsqueeze(-3) == 0, -1e9)
        p_attn = F.softmax(scores, dim = -2)
        if dropout is not None:
            p_attn = dropout(p_attn)
        return torch.sum(p_attn*value.unsqueeze(-3), -2), p_attn

    def forward(self, query, key, value, mask=None, dropout=None):
        "Compute 'Scaled Dot Product Attention'"
        batch, seq_len, dim = value.size()
        if mask is not None:
            # Same mask applied to all h heads.
            mask = mask.unsqueeze(1)
        value = value.unsqueeze(1)
        query, key = [l(x).view(x.size(0), -1, self.h, self.embed_time_k).transpose(1, 2)
                      for l, x in zip(self.linears, (query, key))]
        x, _ = self.attention(query, key, value, mask, dropout)
        x = x.transpose(1, 2).contiguous() \
             .view(batch, -1, self.h * dim)
        return self.linears[-1](x)


class enc_mtan_rnn(nn.Module):
    def __init__(self, input_dim, query, latent_dim=2, nhidden=16,
                 embed_time=16, num_heads=1, learn_emb=False, device='cuda'):
        super(enc_mtan_rnn, self).__init__()
        self.embed_time = embed_time
        self.dim = input_dim
        self.device = device
        self.nhidden = nhidden
        self.query = query
        self.learn_emb = learn_emb
        self.att = multiTimeAttention(2*input_dim, nhidden, embed_time, num_heads)
        self.gru_rnn = nn.GRU(nhidden, nhidden, bidirectional=True, batch_first=True)
        self.hiddens_to_z0 = nn.Sequential(
            nn.Linear(2*nhidden, 50),
            nn.ReLU(),
            nn.Linear(50, latent_dim * 2))
        if learn_emb:
            self.periodic = nn.Linear(1, embed_time-1)
            self.linear = nn.Linear(1, 1)

    def learn_time_embedding(self, tt):
        tt = tt.to(self.device)
        tt = tt.unsqueeze(-1)
        out2 = torch.sin(self.periodic(tt))
        out1 = self.linear(tt)
        return torch.cat([out1, out2], -1)

    def fixed_time_embedding(self, pos):
        d_model=self.embed_time
        pe = torch.zeros(pos.shape[0], pos.shape[1], d_model)
        position = 48.*pos.unsqueeze(2)
        div_term = torch.exp(torch.arange(0, d_model, 2) *
                             -(np.log(10.0) / d_model))
        pe[:, :, 0::2] = torch.sin(position * div_term)
        pe[:, :, 1::2] = torch.cos(position * div_term)
        return pe

    def forward(self, x, time_steps):
        time_steps = time_steps.cpu()
        mask = x[:, :, self.dim:]
        mask = torch.cat((mask, mask), 2)
        if self.learn_emb:
            key = self.learn_time_embedding(time_steps).to(self.device)
            query = self.learn_time_embedding(self.query.unsqueeze(0)).to(self.device)
        else:
            key = self.fixed_time_embedding(time_steps).to(self.device)
            query = self.fixed_time_embedding(self.query.unsqueeze(0)).to(self.device)
        out = self.att(query, key, x, mask)
        out, _ = self.gru_rnn(out)
        out = self.hiddens_to_z0(out)
        return out


class dec_mtan_rnn(nn.Module):

    def __init__(self, input_dim, query, latent_dim=2, nhidden=16,
                 embed_time=16, num_heads=1, learn_emb=False, device='cuda'):
        super(dec_mtan_rnn, self).__init__()
        self.embed_time = embed_time
        self.dim = input_dim
        self.device = device
        self.nhidden = nhidden
        self.query = query
        self.learn_emb = learn_emb
        self.att = multiTimeAttention(2*nhidden, 2*nhidden, embed_time, num_heads)
        self.gru_rnn = nn.GRU(latent_dim, nhidden, bidirectional=True, batch_first=True)
        self.z0_to_obs = nn.Sequential(
            nn.Linear(2*nhidden, 50),
            nn.ReLU(),
            nn.Linear(50, input_dim))
        if learn_emb:
            self.periodic = nn.Linear(1, embed_time-1)
            self.linear = nn.Linear(1, 1)

    def learn_time_embedding(self, tt):
        tt = tt.to(self.device)
        tt = tt.unsqueeze(-1)
        out2 = torch.sin(self.periodic(tt))
        out1 = self.linear(tt)
        return torch.cat([out1, out2], -1)

    def fixed_time_embedding(self, pos):
        d_model = self.embed_time
        pe = torch.zeros(pos.shape[0], pos.shape[1], d_model)
        position = 48.*pos.unsqueeze(2)
        div_term = torch.exp(torch.arange(0, d_model, 2) *
                             -(np.log(10.0) / d_model))
        pe[:, :, 0::2] = torch.sin(position * div_term)
        pe[:, :, 1::2] = torch.cos(position * div_term)
        return pe

    def forward(self, z, time_steps):
        out, _ = self.gru_rnn(z)
        time_steps = time_steps.cpu()
        if self.learn_emb:
            query = self.learn_time_embedding(time_steps).to(self.device)
            key = self.learn_time_embedding(self.query.unsqueeze(0)).to(self.device)
        else:
            query = self.fixed_time_embedding(time_steps).to(self.device)
            key = self.fixed_time_embedding(self.query.unsqueeze(0)).to(self.device)
        out = self.att(query, key, out)
        out = self.z0_to_obs(out)
        return out


# ---- src/utils.py ----
def log_normal_pdf(x, mean, logvar, mask):
    const = torch.from_numpy(np.array([2. * np.pi])).float().to(x.device)
    const = torch.log(const)
    return -.5 * (const + logvar + (x - mean) ** 2. / torch.exp(logvar)) * mask


def normal_kl(mu1, lv1, mu2, lv2):
    v1 = torch.exp(lv1)
    v2 = torch.exp(lv2)
    lstd1 = lv1 / 2.
    lstd2 = lv2 / 2.

    kl = lstd2 - lstd1 + ((v1 + (mu1 - mu2) ** 2.) / (2. * v2)) - .5
    return kl


def mean_squared_error(orig, pred, mask):
    error = (orig - pred) ** 2
    error = error * mask
    return error.sum() / mask.sum()


def normalize_masked_data(data, mask, att_min, att_max):
    # we don't want to divide by zero
    att_max[att_max == 0.] = 1.

    if (att_max != 0.).all():
        data_norm = (data - att_min) / att_max
    else:
        raise Exception("Zero!")

    if torch.isnan(data_norm).any():
        raise Exception("nans!")

    # set masked out elements back to zero
    data_norm[mask == 0] = 0

    return data_norm, att_min, att_max


def compute_losses(dim, dec_train_batch, qz0_mean, qz0_logvar, pred_x, args, device):
    observed_data, observed_mask \
        = dec_train_batch[:, :, :dim], dec_train_batch[:, :, dim:2*dim]

    noise_std = args.std  # default 0.1
    noise_std_ = torch.zeros(pred_x.size()).to(device) + noise_std
    noise_logvar = 2. * torch.log(noise_std_).to(device)
    logpx = log_normal_pdf(observed_data, pred_x, noise_logvar,
                           observed_mask).sum(-1).sum(-1)
    pz0_mean = pz0_logvar = torch.zeros(qz0_mean.size()).to(device)
    analytic_kl = normal_kl(qz0_mean, qz0_logvar,
                            pz0_mean, pz0_logvar).sum(-1).sum(-1)
    if args.norm:
        logpx /= observed_mask.sum(-1).sum(-1)
        analytic_kl /= observed_mask.sum(-1).sum(-1)
    return logpx, analytic_kl


def variable_time_collate_fn(batch, device=torch.device("cpu"), classify=False, activity=False,
                             data_min=None, data_max=None):
    D = batch[0][2].shape[1]
    # number of labels
    N = batch[0][-1].shape[1] if activity else 1
    len_tt = [ex[1].size(0) for ex in batch]
    maxlen = np.max(len_tt)
    enc_combined_tt = torch.zeros([len(batch), maxlen]).to(device)
    enc_combined_vals = torch.zeros([len(batch), maxlen, D]).to(device)
    enc_combined_mask = torch.zeros([len(batch), maxlen, D]).to(device)
    if classify:
        if activity:
            combined_labels = torch.zeros([len(batch), maxlen, N]).to(device)
        else:
            combined_labels = torch.zeros([len(batch), N]).to(device)

    for b, (record_id, tt, vals, mask, labels) in enumerate(batch):
        currlen = tt.size(0)
        enc_combined_tt[b, :currlen] = tt.to(device)
        enc_combined_vals[b, :currlen] = vals.to(device)
        enc_combined_mask[b, :currlen] = mask.to(device)
        if classify:
            if activity:
                combined_labels[b, :currlen] = labels.to(device)
            else:
                combined_labels[b] = labels.to(device)

    if not activity:
        enc_combined_vals, _, _ = normalize_masked_data(enc_combined_vals, enc_combined_mask,
                                                        att_min=data_min, att_max=data_max)

    if torch.max(enc_combined_tt) != 0.:
        enc_combined_tt = enc_combined_tt / torch.max(enc_combined_tt)

    combined_data = torch.cat(
        (enc_combined_vals, enc_combined_mask, enc_combined_tt.unsqueeze(-1)), 2)
    if classify:
        return combined_data, combined_labels
    else:
        return combined_data


# ---- a small PhysioNet-like batch (record_id, tt, vals, mask, labels) ----
class Args:
    latent_dim = 8
    rec_hidden = 16
    gen_hidden = 12
    num_ref_points = 16
    enc_num_heads = 2
    dec_num_heads = 2
    learn_emb = True
    std = 0.01
    norm = True
    k_iwae = 1


args = Args()
device = torch.device('cpu')
dim = 5
lengths = [13, 6, 9, 3]
records = []
for i, L in enumerate(lengths):
    tt = torch.sort(torch.rand(L) * 48.0).values          # hours since admission
    vals = torch.randn(L, dim) * 3.0 + 10.0
    mask = (torch.rand(L, dim) < 0.5).float()
    mask[torch.arange(L), torch.randint(0, dim, (L,))] = 1.  # each time has at least one measurement
    vals = vals * mask
    records.append(("rec%d" % i, tt, vals, mask, torch.tensor([[float(i % 2)]])))
data_min = torch.full((dim,), 0.)
data_max = torch.full((dim,), 20.)

train_batch, label = variable_time_collate_fn(records, device, classify=True,
                                              data_min=data_min, data_max=data_max)
label = label.long().squeeze()

rec = enc_mtan_rnn(
    dim, torch.linspace(0, 1., args.num_ref_points), args.latent_dim, args.rec_hidden,
    embed_time=16, learn_emb=args.learn_emb, num_heads=args.enc_num_heads, device=device).to(device)
dec = dec_mtan_rnn(
    dim, torch.linspace(0, 1., args.num_ref_points), args.latent_dim, args.gen_hidden,
    embed_time=16, learn_emb=args.learn_emb, num_heads=args.dec_num_heads, device=device).to(device)
classifier = create_classifier(args.latent_dim, args.rec_hidden).to(device)
rec.eval(); dec.eval(); classifier.eval()


def step(train_batch):
    # src/tan_classification.py, one training step, with epsilon = 0 (the posterior mean) so runs compare
    batch_len = train_batch.shape[0]
    observed_data, observed_mask, observed_tp \
        = train_batch[:, :, :dim], train_batch[:, :, dim:2*dim], train_batch[:, :, -1]
    out = rec(torch.cat((observed_data, observed_mask), 2), observed_tp)
    qz0_mean, qz0_logvar = out[:, :, :args.latent_dim], out[:, :, args.latent_dim:]
    epsilon = torch.zeros(args.k_iwae, qz0_mean.shape[0], qz0_mean.shape[1], qz0_mean.shape[2]).to(device)
    z0 = epsilon * torch.exp(.5 * qz0_logvar) + qz0_mean
    z0 = z0.view(-1, qz0_mean.shape[1], qz0_mean.shape[2])
    pred_y = classifier(z0)
    pred_x = dec(
        z0, observed_tp[None, :, :].repeat(args.k_iwae, 1, 1).view(-1, observed_tp.shape[1]))
    pred_x = pred_x.view(args.k_iwae, batch_len, pred_x.shape[1], pred_x.shape[2])
    logpx, analytic_kl = compute_losses(dim, train_batch, qz0_mean, qz0_logvar, pred_x, args, device)
    return qz0_mean, qz0_logvar, pred_y, pred_x, logpx, analytic_kl


with torch.no_grad():
    qz0_mean, qz0_logvar, pred_y, pred_x, logpx, analytic_kl = step(train_batch)
    ce_loss = nn.CrossEntropyLoss()(pred_y.view(-1, 2), label)
    mse = mean_squared_error(train_batch[:, :, :dim], pred_x.mean(0), train_batch[:, :, dim:2*dim])
    print("ce_loss %.5f  mse %.5f  logpx %s" % (ce_loss.item(), mse.item(), logpx.view(-1).numpy().round(2)))

    # reference: each record cut to its own observation times (same normalised tt) and run alone
    worst = 0.
    ref_logpx = []
    for b, L in enumerate(lengths):
        m, lv, py, px, lp, kl = step(train_batch[b:b + 1, :L])
        worst = max(worst,
                    (m[0] - qz0_mean[b]).abs().max().item(),
                    (lv[0] - qz0_logvar[b]).abs().max().item(),
                    (py.view(-1) - pred_y.view(len(lengths), -1)[b]).abs().max().item(),
                    (px[0, 0] - pred_x[0, b, :L]).abs().max().item(),
                    (kl.view(-1) - analytic_kl.view(-1)[b]).abs().max().item())
        ref_logpx.append(lp.view(-1)[0].item())
    worst_lp = max(abs(a - b) for a, b in zip(ref_logpx, logpx.view(-1).tolist()))
    print("max |padded batch - per-record| = %.2e, logpx diff = %.2e" % (worst, worst_lp))
    assert worst < 1e-4 and worst_lp < 1e-3, (worst, worst_lp)
print("ok")
