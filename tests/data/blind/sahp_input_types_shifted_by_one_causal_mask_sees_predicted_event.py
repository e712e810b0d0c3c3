# yangalan123/anhp-andtt commit 522cb49abceba8199c18bbeaec1afb582a819c11 (bug-fixed SAHP of QiangAIResearcher/sahp_repo).
# SAHP's training loop fed the encoder types[:, 1:] and inter-event times t[1:] - t[:-1] under a causal mask that keeps
# the diagonal, so the state that scores event i+1 attends to event i+1's own type and arrival time. The fix feeds
# times[:, :-1] and types[:, :-1] (BOS .. event i) under the same mask.
import math
import random
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import Variable

FIXED = "--fixed" in sys.argv


class GELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


class LayerNorm(nn.Module):
    def __init__(self, size, eps=1e-6):
        super(LayerNorm, self).__init__()
        self.a_2 = nn.Parameter(torch.ones(size))
        self.b_2 = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.a_2 * (x - mean) / (std + self.eps) + self.b_2


class SublayerConnection(nn.Module):
    def __init__(self, size, dropout):
        super(SublayerConnection, self).__init__()
        self.norm = LayerNorm(size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, sublayer):
        return x + self.dropout(sublayer(self.norm(x)))


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1):
        super(PositionwiseFeedForward, self).__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = GELU()

    def forward(self, x):
        return self.w_2(self.dropout(self.activation.forward(self.w_1(x))))


class TypeEmbedding(nn.Embedding):
    def __init__(self, type_size, embed_size, padding_idx):
        super().__init__(type_size, embed_size, padding_idx=padding_idx)


class BiasedPositionalEmbedding(nn.Module):
    def __init__(self, d_model, max_len=4096):
        super().__init__()
        position = torch.arange(0, max_len).float().unsqueeze(1)
        div_term = (torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model)).exp()
        self.register_buffer('position', position)
        self.register_buffer('div_term', div_term)
        self.Wt = nn.Linear(1, d_model // 2, bias=False)

    def forward(self, x, interval):
        phi = self.Wt(interval.unsqueeze(-1))
        aa = len(x.size())
        if aa > 1:
            length = x.size(1)
        else:
            length = x.size(0)
        arc = (self.position[:length] * self.div_term).unsqueeze(0)
        pe_sin = torch.sin(arc + phi)
        pe_cos = torch.cos(arc + phi)
        pe = torch.cat([pe_sin, pe_cos], dim=-1)
        return pe


class Attention(nn.Module):
    def forward(self, query, key, value, mask=None, dropout=None):
        scores = torch.exp(torch.matmul(query, key.transpose(-2, -1))) \
                 / math.sqrt(query.size(-1))
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        p_attn = F.softmax(scores, dim=-1)
        if dropout is not None:
            p_attn = dropout(p_attn)
        return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, dropout=0.1):
        super().__init__()
        assert d_model % h == 0
        self.d_k = d_model // h
        self.h = h
        self.linear_layers = nn.ModuleList([nn.Linear(d_model, d_model, bias=True) for _ in range(3)])
        self.output_linear = nn.Linear(d_model, d_model, bias=True)
        self.attention = Attention()
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            mask = mask.unsqueeze(1)
        batch_size = query.size(0)
        query, key, value = [l(x).view(batch_size, -1, self.h, self.d_k).transpose(1, 2)
                             for l, x in zip(self.linear_layers, (query, key, value))]
        x, attn = self.attention.forward(query, key, value, mask=mask, dropout=self.dropout)
        x = x.transpose(1, 2).contiguous().view(batch_size, -1, self.h * self.d_k)
        return self.output_linear(x)


class SAHP(nn.Module):
    "Generic N layer attentive Hawkes with masking"

    def __init__(self, nLayers, d_model, atten_heads, dropout, process_dim, device, max_sequence_length):
        super(SAHP, self).__init__()
        self.nLayers = nLayers
        self.process_dim = process_dim
        self.input_size = process_dim + 1
        self.query_size = d_model // atten_heads
        self.device = device
        self.gelu = GELU()

        self.d_model = d_model
        self.type_emb = TypeEmbedding(self.input_size, d_model, padding_idx=self.process_dim)
        self.position_emb = BiasedPositionalEmbedding(d_model=d_model, max_len=max_sequence_length)

        self.attention = MultiHeadedAttention(h=atten_heads, d_model=self.d_model)
        self.feed_forward = PositionwiseFeedForward(d_model=self.d_model, d_ff=self.d_model * 4, dropout=dropout)
        self.input_sublayer = SublayerConnection(size=self.d_model, dropout=dropout)
        self.output_sublayer = SublayerConnection(size=self.d_model, dropout=dropout)
        self.dropout = nn.Dropout(p=dropout)

        self.start_layer = nn.Sequential(nn.Linear(self.d_model, self.d_model, bias=True), self.gelu)
        self.converge_layer = nn.Sequential(nn.Linear(self.d_model, self.d_model, bias=True), self.gelu)
        self.decay_layer = nn.Sequential(nn.Linear(self.d_model, self.d_model, bias=True), nn.Softplus(beta=10.0))
        self.intensity_layer = nn.Sequential(nn.Linear(self.d_model, self.process_dim, bias=True), nn.Softplus(beta=1.))

    def state_decay(self, converge_point, start_point, omega, duration_t):
        cell_t = torch.tanh(converge_point + (start_point - converge_point) * torch.exp(- omega * duration_t))
        return cell_t

    def forward(self, seq_dt, seq_types, src_mask):
        type_embedding = self.type_emb(seq_types) * math.sqrt(self.d_model)
        position_embedding = self.position_emb(seq_types, seq_dt)

        x = type_embedding + position_embedding
        for i in range(self.nLayers):
            x = self.input_sublayer(x, lambda _x: self.attention.forward(_x, _x, _x, mask=src_mask))
            x = self.dropout(self.output_sublayer(x, self.feed_forward))

        embed_info = x

        self.start_point = self.start_layer(embed_info)
        self.converge_point = self.converge_layer(embed_info)
        self.omega = self.decay_layer(embed_info)

    def compute_loss(self, seq_times, seq_onehot_types, n_mc_samples=20):
        dt_seq = seq_times[:, 1:] - seq_times[:, :-1]
        cell_t = self.state_decay(self.converge_point, self.start_point, self.omega, dt_seq[:, :, None])

        n_batch = seq_times.size(0)
        n_times = seq_times.size(1) - 1
        device = dt_seq.device
        intens_at_evs = self.intensity_layer(cell_t)
        intens_at_evs = nn.utils.rnn.pad_sequence(intens_at_evs, padding_value=1.0, batch_first=True)
        log_intensities = intens_at_evs.log()
        seq_mask = seq_onehot_types[:, 1:]
        if FIXED:
            log_intensities_ret = (log_intensities * seq_mask).sum(dim=2)
        log_sum = (log_intensities * seq_mask).sum(dim=(2, 1))

        taus = torch.rand(n_batch, n_times, 1, n_mc_samples).to(device)
        taus = dt_seq[:, :, None, None] * taus

        cell_tau = self.state_decay(
            self.converge_point[:, :, :, None],
            self.start_point[:, :, :, None],
            self.omega[:, :, :, None],
            taus)
        cell_tau = cell_tau.transpose(2, 3)
        intens_at_samples = self.intensity_layer(cell_tau).transpose(2, 3)
        intens_at_samples = nn.utils.rnn.pad_sequence(intens_at_samples, padding_value=0.0, batch_first=True)

        total_intens_samples = intens_at_samples.sum(dim=2)
        partial_integrals = dt_seq * total_intens_samples.mean(dim=2)

        integral_ = partial_integrals.sum(dim=1)

        res = torch.sum(- log_sum + integral_)
        if FIXED:
            return res, log_intensities, log_intensities_ret, partial_integrals
        return res


def subsequent_mask(size):
    "mask out subsequent positions"
    atten_shape = (1, size, size)
    mask = np.triu(np.ones(atten_shape), k=1).astype('uint8')
    aaa = torch.from_numpy(mask) == 0
    return aaa


class MaskBatch():
    "object for holding a batch of data with mask during training"
    def __init__(self, src, pad, device):
        self.src = src
        self.src_mask = self.make_std_mask(self.src, pad, device)

    @staticmethod
    def make_std_mask(tgt, pad, device):
        "create a mask to hide padding and future input"
        tgt_mask = (tgt != pad).unsqueeze(-2)
        tgt_mask = tgt_mask & Variable(subsequent_mask(tgt.size(-1)).type_as(tgt_mask.data)).to(device)
        return tgt_mask


def one_hot_embedding(labels, num_classes):
    device = labels.device
    y = torch.eye(num_classes).to(device)
    return y[labels]


def process_loaded_sequences(loaded_hawkes_data, process_dim):
    seq_lengths = torch.Tensor(loaded_hawkes_data['lengths']).int()
    event_times_list = [torch.from_numpy(e) for e in loaded_hawkes_data['timestamps']]
    event_types_list = [torch.from_numpy(e) for e in loaded_hawkes_data['types']]
    tmax = 0
    for tsr in event_times_list:
        if torch.max(tsr) > tmax:
            tmax = torch.max(tsr)
    seq_times = nn.utils.rnn.pad_sequence(event_times_list, batch_first=True, padding_value=tmax).float()
    seq_times = torch.cat((torch.zeros_like(seq_times[:, :1]), seq_times), dim=1)
    seq_types = nn.utils.rnn.pad_sequence(event_types_list, batch_first=True, padding_value=process_dim)
    seq_types = torch.cat((process_dim * torch.ones_like(seq_types[:, :1]), seq_types), dim=1).long()
    return seq_times, seq_types, seq_lengths, tmax


def get_batch(batch_size, i_batch, model, seq_lengths, seq_times, seq_types, rnn=True):
    start_pos = i_batch
    end_pos = i_batch + batch_size
    batch_seq_lengths = seq_lengths[start_pos:end_pos]
    max_seq_length = batch_seq_lengths[0]
    batch_seq_times = seq_times[start_pos:end_pos, :max_seq_length + 1]
    batch_seq_types = seq_types[start_pos:end_pos, :max_seq_length + 1]
    batch_dt = batch_seq_times[:, 1:] - batch_seq_times[:, :-1]
    batch_onehot = one_hot_embedding(batch_seq_types, model.input_size)
    batch_onehot = batch_onehot[:, :, :model.process_dim]
    packed_dt, packed_types, max_pack_batch_size = None, None, 0
    return batch_onehot, batch_seq_times, batch_dt, batch_seq_types, \
        max_pack_batch_size, packed_dt, packed_types, batch_seq_lengths


def main():
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    device = torch.device("cpu")
    process_dim = 3  # retweet
    args = dict(d_model=32, atten_heads=4, nLayers=2, dropout=0.1, lr=5e-5, lambda_l2=3e-4, batch_size=4)

    # small synthetic stand-in for the retweet sequences (variable lengths, padded with process_dim / tmax)
    lengths = [12, 9, 7, 5, 11, 4, 8, 6]
    data = {"lengths": lengths, "timestamps": [], "types": []}
    for n in lengths:
        data["timestamps"].append(np.cumsum(np.random.exponential(1.0, size=n)).astype(np.float32))
        data["types"].append(np.random.randint(0, process_dim, size=n))
    train_seq_times, train_seq_types, train_seq_lengths, tmax = process_loaded_sequences(data, process_dim)

    train_seq_lengths, reorder_indices_train = train_seq_lengths.sort(descending=True)
    train_seq_times = train_seq_times[reorder_indices_train]
    train_seq_types = train_seq_types[reorder_indices_train]
    max_sequence_length = train_seq_lengths[0]

    model = SAHP(nLayers=args["nLayers"], d_model=args["d_model"], atten_heads=args["atten_heads"],
                 dropout=args["dropout"], process_dim=process_dim, device=device,
                 max_sequence_length=int(max_sequence_length) + 1).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args["lr"], betas=(0.9, 0.98), eps=1e-9,
                                 weight_decay=args["lambda_l2"])

    batch_size = args["batch_size"]
    tr_loop_range = list(range(0, train_seq_times.size(0), batch_size))
    model.train()
    epoch_train_loss = 0.0
    for i_batch in tr_loop_range:
        optimizer.zero_grad()
        batch_onehot, batch_seq_times, batch_dt, batch_seq_types, _, _, _, batch_seq_lengths = \
            get_batch(batch_size, i_batch, model, train_seq_lengths, train_seq_times, train_seq_types, rnn=False)

        if FIXED:
            batch_seq_types_ = batch_seq_types[:, 1:]
            masked_seq_types = MaskBatch(batch_seq_types_, pad=model.process_dim, device=device)
            model.forward(batch_seq_times[:, :-1], batch_seq_types[:, :-1], masked_seq_types.src_mask)
            nll, _, _, _ = model.compute_loss(batch_seq_times, batch_onehot)
        else:
            batch_seq_types = batch_seq_types[:, 1:]
            masked_seq_types = MaskBatch(batch_seq_types, pad=model.process_dim, device=device)
            model.forward(batch_dt, masked_seq_types.src, masked_seq_types.src_mask)
            nll = model.compute_loss(batch_seq_times, batch_onehot)

        loss = nll
        loss.backward()
        optimizer.step()
        epoch_train_loss += loss.detach()

    print(f"train nll per event {epoch_train_loss.item() / train_seq_lengths.sum().item():.4f}")


if __name__ == "__main__":
    main()
