"""Trajectory Transformer (jannerm/trajectory-transformer), shrunk.

Each transition is flattened into transition_dim = obs_dim + act_dim + 2 tokens
[s^0 .. s^{N-1} | a^0 .. a^{M-1} | r | V].  The attention mask is minGPT's causal
tril, with every column at a value-token position (joined_dim-1 :: joined_dim)
zeroed, so no later token can read a previous value estimate (values hold
information about the future).  Training rows come from trajectories padded at
the end with the termination token; positions past max_path_length are
excluded from the loss by `mask`.  At planning time the context is cropped a
whole transition at a time (crop_increment = transition_dim) so the first
token is always s_t^0 and the value columns of the fixed-position mask still
line up with the value tokens.

Ported from jannerm/trajectory-transformer @344304c1cc8d8130e339bfb024c450e3bebdd434:
  trajectory/models/transformers.py (CausalSelfAttention mask + value columns, GPT.forward,
                                     offset_tokens, pad_to_full_observation)
  trajectory/models/ein.py          (EinLinear: one head per token slot)
  trajectory/datasets/sequence.py   (segment / DiscretizedDataset.__getitem__: stop-token padding, loss mask)
  trajectory/search/sampling.py     (forward with crop, sample, sample_n) @3b7654a56315245d6162c91e3f595571b05e45cd

Checks (all must match):
  1. every row of a padded training batch == a per-query loop where query i
     sees keys j <= i whose slot j % transition_dim is not the value slot;
  2. each row's logits on its real (unterminated) prefix == that prefix run
     alone (the stop-token tail after it changes nothing before it);
  3. sample_n with cropping: each step's last logits == the per-query loop
     over the cropped window, and == the window re-based on its own (the crop
     keeps transition alignment).
"""
import math

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

torch.manual_seed(0)
np.random.seed(0)
torch.set_default_dtype(torch.float64)


class Config:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class EinLinear(nn.Module):
    def __init__(self, n_models, in_features, out_features, bias):
        super().__init__()
        self.n_models = n_models
        self.weight = nn.Parameter(torch.randn(n_models, out_features, in_features) * 0.1)
        self.bias = nn.Parameter(torch.zeros(n_models, out_features)) if bias else None

    def forward(self, input):
        # [ B x n_models x input_dim ] -> [ B x n_models x output_dim ]
        output = torch.einsum('eoi,bei->beo', self.weight, input)
        if self.bias is not None:
            raise RuntimeError()
        return output


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.key = nn.Linear(config.n_embd, config.n_embd)
        self.query = nn.Linear(config.n_embd, config.n_embd)
        self.value = nn.Linear(config.n_embd, config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.register_buffer("mask", torch.tril(torch.ones(config.block_size, config.block_size))
                             .view(1, 1, config.block_size, config.block_size))
        ## mask previous value estimates
        joined_dim = config.observation_dim + config.action_dim + 2
        self.mask.squeeze()[:, joined_dim - 1::joined_dim] = 0
        self.n_head = config.n_head

    def forward(self, x):
        B, T, C = x.size()
        k = self.key(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = self.query(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float('-inf'))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok_emb = nn.Embedding(config.vocab_size * config.transition_dim + 1, config.n_embd)
        self.pos_emb = nn.Parameter(torch.randn(1, config.block_size, config.n_embd) * 0.1)
        self.blocks = nn.Sequential(*[Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = EinLinear(config.transition_dim, config.n_embd, config.vocab_size + 1, bias=False)
        self.vocab_size = config.vocab_size
        self.stop_token = config.vocab_size * config.transition_dim
        self.block_size = config.block_size
        self.transition_dim = config.transition_dim
        self.embedding_dim = config.n_embd

    def get_block_size(self):
        return self.block_size

    def offset_tokens(self, idx):
        _, t = idx.shape
        n_states = int(np.ceil(t / self.transition_dim))
        offsets = torch.arange(self.transition_dim) * self.vocab_size
        offsets = offsets.repeat(n_states)
        offset_idx = idx + offsets[:t]
        offset_idx[idx == self.vocab_size] = self.stop_token
        return offset_idx

    def pad_to_full_observation(self, x):
        b, t, _ = x.shape
        n_pad = (self.transition_dim - t % self.transition_dim) % self.transition_dim
        padding = torch.zeros(b, n_pad, self.embedding_dim)
        x_pad = torch.cat([x, padding], dim=1)
        x_pad = x_pad.view(-1, self.transition_dim, self.embedding_dim)
        return x_pad, n_pad

    def embed(self, idx):
        t = idx.size(1)
        return self.tok_emb(self.offset_tokens(idx)) + self.pos_emb[:, :t, :]

    def heads(self, x, b, t):
        x = self.ln_f(x)
        x_pad, n_pad = self.pad_to_full_observation(x)
        logits = self.head(x_pad)
        logits = logits.reshape(b, t + n_pad, self.vocab_size + 1)
        return logits[:, :t]

    def forward(self, idx, targets=None, mask=None):
        b, t = idx.size()
        assert t <= self.block_size, "Cannot forward, model block size is exhausted."
        x = self.blocks(self.embed(idx))
        logits = self.heads(x, b, t)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.view(-1), reduction='none')
            loss = (loss * mask.view(-1)).mean()
        return logits, loss


# ---------------------------------------------------------------- search/sampling.py
def round_to_multiple(x, N):
    pad = (N - x % N) % N
    return x + pad


def forward(model, x, max_block=None, allow_crop=True, crop_increment=None, **kwargs):
    model.eval()
    block_size = min(model.get_block_size(), max_block or np.inf)
    if x.shape[1] > block_size:
        assert allow_crop
        ## crop out entire transition at a time so that the first token is always s_t^0
        n_crop = round_to_multiple(x.shape[1] - block_size, crop_increment)
        assert n_crop % crop_increment == 0
        x = x[:, n_crop:]
    logits, _ = model(x, **kwargs)
    return logits, x


def sample(model, x, temperature=1.0, **forward_kwargs):
    logits, window = forward(model, x, **forward_kwargs)
    logits = logits[:, -1] / temperature
    raw_probs = logits.softmax(dim=-1)
    probs = logits.softmax(dim=-1)
    indices = torch.multinomial(probs, num_samples=1)
    return indices, raw_probs, window, logits


@torch.no_grad()
def sample_n(model, x, N, **sample_kwargs):
    windows, step_logits = [], []
    for n in range(N):
        indices, p, window, lg = sample(model, x, **sample_kwargs)
        windows.append(window)
        step_logits.append(lg)
        x = torch.cat((x, indices), dim=1)
    return x, windows, step_logits


# ----------------------------------------------------------------- references
def loop_reference(model, idx):
    """Per-query loop: query i attends to keys j <= i with j % transition_dim != value slot."""
    b, t = idx.shape
    td = model.transition_dim
    x = model.embed(idx)
    for blk in model.blocks:
        a = blk.attn
        h = blk.ln1(x)
        C = h.size(-1)
        nh, hd = a.n_head, C // a.n_head
        q = a.query(h).view(b, t, nh, hd)
        k = a.key(h).view(b, t, nh, hd)
        v = a.value(h).view(b, t, nh, hd)
        y = torch.zeros(b, t, nh, hd)
        for i in range(t):
            js = [j for j in range(i + 1) if j % td != td - 1]
            s = torch.einsum('bhd,bjhd->bhj', q[:, i], k[:, js]) / math.sqrt(hd)
            y[:, i] = torch.einsum('bhj,bjhd->bhd', torch.softmax(s, -1), v[:, js])
        x = x + a.proj(y.reshape(b, t, C))
        x = x + blk.mlp(blk.ln2(x))
    return model.heads(x, b, t)


def make_training_batch(N, obs_dim, act_dim, seq_transitions, max_path_length, path_lengths):
    """sequence.py's segment + DiscretizedDataset.__getitem__ (step=1), on random discrete data."""
    td = obs_dim + act_dim + 2
    X, Y, M, real_len = [], [], [], []
    for path_length, start in zip(path_lengths, [0, 1, 2]):
        joined = np.random.randint(0, N, size=(max_path_length + seq_transitions - 1, td))
        term = np.zeros(max_path_length + seq_transitions - 1, dtype=bool)
        term[path_length:] = True
        end = start + seq_transitions
        jd = joined[start:end].copy()
        tf = term[start:end]
        jd[tf] = N                              # termination token after the path ends
        traj_inds = np.arange(start, end)
        mask = np.ones(jd.shape, dtype=bool)
        mask[traj_inds > max_path_length - 1] = 0
        jd = torch.tensor(jd.reshape(-1))
        mask = torch.tensor(mask.reshape(-1))
        X.append(jd[:-1]); Y.append(jd[1:]); M.append(mask[:-1])
        real_len.append(int((~tf).sum()) * td)
    return torch.stack(X), torch.stack(Y), torch.stack(M).double(), real_len


def main():
    obs_dim, act_dim, N = 2, 1, 7
    td = obs_dim + act_dim + 2                 # 5
    seq_transitions = 4
    cfg = Config(vocab_size=N, transition_dim=td, observation_dim=obs_dim, action_dim=act_dim,
                 block_size=seq_transitions * td - 1, n_layer=2, n_head=2, n_embd=16)
    model = GPT(cfg).eval()
    ok_all = True

    # 1 + 2. padded training batch
    X, Y, M, real_len = make_training_batch(N, obs_dim, act_dim, seq_transitions,
                                            max_path_length=6, path_lengths=[6, 3, 4])
    with torch.no_grad():
        logits, loss = model(X, targets=Y, mask=M)
        ref = loop_reference(model, X)
    ok1 = torch.allclose(logits, ref, atol=1e-10) and bool(torch.isfinite(loss))
    print('training batch (stop-token tails) matches per-query loop with value columns closed:', ok1)
    ok_all &= ok1

    ok2 = True
    with torch.no_grad():
        for r in range(X.size(0)):
            n = min(real_len[r], X.size(1))
            alone, _ = model(X[r:r + 1, :n])
            ok2 &= torch.allclose(logits[r:r + 1, :n], alone, atol=1e-10)
    print('each row\'s real prefix matches the prefix run alone:', ok2, real_len)
    ok_all &= ok2

    # 3. planning rollout with cropping
    torch.manual_seed(3)
    context = torch.randint(0, N, (2, 3 * td + obs_dim))        # 3 transitions + current obs
    x, windows, step_logits = sample_n(model, context, N=2 * td + 1, crop_increment=td)
    ok3 = True
    with torch.no_grad():
        for w, lg in zip(windows, step_logits):
            ref = loop_reference(model, w)[:, -1]
            ok3 &= torch.allclose(lg, ref, atol=1e-10)
    # window start positions (in the uncropped sequence) are multiples of transition_dim
    starts = []
    for n, w in enumerate(windows):
        total = context.size(1) + n
        starts.append(total - w.size(1))
    # (the window starts on a transition boundary: s_t^0 at position 0), and some steps were cropped
    ok3 &= all(s % td == 0 for s in starts) and max(starts) > 0
    print(f'cropped planning rollout ({len(windows)} steps, window starts {sorted(set(starts))}) matches per-query loop:', ok3)
    ok_all &= ok3

    print('ALL MATCH' if ok_all else 'MISMATCH')
    assert ok_all


if __name__ == '__main__':
    main()
