# MIDI-Transformer, compound-word CPTransformer (s-omranpour/MIDI-Transformer#1, fixed in commit 7ffa9e3).
# Bug: the example config set self_attention_type "linear", so EncoderBlock built a FullMask and fast_transformers'
# non-causal LinearAttention: every compound token attended to future tokens during next-token training.
import sys
import math
from collections import OrderedDict

import torch
from torch import nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

# ---------------- examples/conf.yaml (model.encoder), sizes shrunk ----------------
attributes = ['ttype', 'position', 'tempo', 'chord', 'instrument', 'pitch', 'duration', 'velocity']
n_tokens = dict(ttype=3, position=17, tempo=21, chord=33, instrument=17, pitch=48, duration=16, velocity=30)
emb_dims = dict(ttype=4, position=4, tempo=4, chord=8, instrument=4, pitch=8, duration=4, velocity=4)
config = {
    'embedding': dict(d_model=32, dropout=0.1, attributes=attributes, n_tokens=n_tokens, max_len=1000, emb_dims=emb_dims),
    'encoder': dict(d_model=32, d_inner=64, n_heads=4,
                    self_attention_type='causal-linear' if FIXED else 'linear',
                    is_decoder=False, dropout=0.1, activation='gelu', n_layers=2, final_norm=True),
    'head': dict(d_model=32, attributes=attributes, n_tokens=n_tokens, emb_dims=emb_dims),
}


# ---------------- fast_transformers (masking, attention, builders), pure-torch path ----------------
class BaseMask:
    all_ones = False
    lower_triangular = False


class FullMask(BaseMask):
    def __init__(self, mask=None, N=None, M=None, device="cpu"):
        if isinstance(mask, int):
            N, mask = mask, None
        M = M or N
        self._mask = mask if mask is not None else torch.ones(N, M, dtype=torch.bool, device=device)
        self.all_ones = bool(torch.all(self._mask))

    @property
    def bool_matrix(self):
        return self._mask


class TriangularCausalMask(BaseMask):
    def __init__(self, N, device="cpu"):
        self._mask = torch.tril(torch.ones(N, N, dtype=torch.bool, device=device))
        self.lower_triangular = True

    @property
    def bool_matrix(self):
        return self._mask


class LengthMask(BaseMask):
    def __init__(self, lengths, max_len=None, device=None):
        self._lengths = lengths
        self.max_len = max_len or int(lengths.max())
        self.float_matrix = (torch.arange(self.max_len, device=lengths.device)[None, :] < lengths[:, None]).float()


def elu_feature_map(x):
    return F.elu(x) + 1


class LinearAttention(nn.Module):
    def __init__(self, query_dimensions, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, queries, keys, values, attn_mask, query_lengths, key_lengths):
        Q = elu_feature_map(queries)
        K = elu_feature_map(keys)
        if not attn_mask.all_ones:
            raise RuntimeError("LinearAttention does not support arbitrary attention masks")
        K = K * key_lengths.float_matrix[:, :, None, None]
        KV = torch.einsum("nshd,nshm->nhmd", K, values)
        Z = 1 / (torch.einsum("nlhd,nhd->nlh", Q, K.sum(dim=1)) + self.eps)
        V = torch.einsum("nlhd,nhmd,nlh->nlhm", Q, KV, Z)
        return V.contiguous()


def causal_dot_product(Q, K, V):
    # (N, H, L, D) x (N, H, L, D) x (N, H, L, M): out_l = sum_{j<=l} (Q_l . K_j) V_j
    KV = torch.einsum("nhld,nhlm->nhldm", K, V).cumsum(dim=2)
    return torch.einsum("nhld,nhldm->nhlm", Q, KV)


class CausalLinearAttention(nn.Module):
    def __init__(self, query_dimensions, eps=1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, queries, keys, values, attn_mask, query_lengths, key_lengths):
        Q = elu_feature_map(queries)
        K = elu_feature_map(keys)
        if not attn_mask.lower_triangular:
            raise RuntimeError("CausalLinearAttention only supports full lower triangular masks")
        K = K * key_lengths.float_matrix[:, :, None, None]
        Z = 1 / (torch.einsum("nlhi,nlhi->nlh", Q, K.cumsum(1)) + self.eps)
        V = causal_dot_product(Q.permute(0, 2, 1, 3).contiguous(), K.permute(0, 2, 1, 3).contiguous(),
                               values.permute(0, 2, 1, 3).contiguous()).permute(0, 2, 1, 3).contiguous()
        return V * Z[:, :, :, None]


class AttentionBuilder:
    _registry = {"linear": LinearAttention, "causal-linear": CausalLinearAttention}

    def __init__(self, **kwargs):
        self.kwargs = kwargs

    @classmethod
    def from_kwargs(cls, **kwargs):
        return cls(**kwargs)

    def get(self, attention_type):
        return self._registry[attention_type](**self.kwargs)


class AttentionLayer(nn.Module):
    def __init__(self, attention, d_model, n_heads, d_keys=None, d_values=None):
        super().__init__()
        d_keys = d_keys or (d_model // n_heads)
        d_values = d_values or (d_model // n_heads)
        self.inner_attention = attention
        self.query_projection = nn.Linear(d_model, d_keys * n_heads)
        self.key_projection = nn.Linear(d_model, d_keys * n_heads)
        self.value_projection = nn.Linear(d_model, d_values * n_heads)
        self.out_projection = nn.Linear(d_values * n_heads, d_model)
        self.n_heads = n_heads

    def forward(self, queries, keys, values, attn_mask, query_lengths, key_lengths):
        N, L, _ = queries.shape
        _, S, _ = keys.shape
        H = self.n_heads
        queries = self.query_projection(queries).view(N, L, H, -1)
        keys = self.key_projection(keys).view(N, S, H, -1)
        values = self.value_projection(values).view(N, S, H, -1)
        new_values = self.inner_attention(queries, keys, values, attn_mask, query_lengths, key_lengths).view(N, L, -1)
        return self.out_projection(new_values)


# ---------------- midi_transformer/modules/encoder.py ----------------
class EncoderBlock(nn.Module):
    def __init__(self, d_model, d_inner=None, n_heads=8, head_dims=None, self_attention_type='full',
                 cross_attention_type='full', is_decoder=False, dropout=0.1, activation='gelu'):
        super().__init__()
        d_inner = d_inner or d_model * 4
        self.self_attention_type = self_attention_type
        self.self_attention = AttentionLayer(
            AttentionBuilder.from_kwargs(query_dimensions=d_model // n_heads).get(self_attention_type),
            d_model, n_heads, d_keys=d_model // n_heads, d_values=d_model // n_heads)
        self.is_decoder = is_decoder
        self.ff1 = nn.Linear(d_model, d_inner)
        self.ff2 = nn.Linear(d_inner, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = F.relu if activation == "relu" else F.gelu

    def forward(self, x, x_mask=None, x_length_mask=None, memory=None, memory_mask=None, memory_length_mask=None):
        if x_mask is None:
            if self.self_attention_type.startswith('causal'):
                x_mask = TriangularCausalMask(x.size(1), device=x.device)
            else:
                x_mask = FullMask(x.size(1), device=x.device)
        elif isinstance(x_mask, torch.Tensor):
            x_mask = FullMask(x_mask, device=x.device)

        if x_length_mask is None:
            x_length_mask = LengthMask(x.new_full((x.size(0),), x.size(1), dtype=int), device=x.device)
        elif isinstance(x_length_mask, torch.Tensor):
            x_length_mask = LengthMask(x_length_mask, device=x.device)

        x = x + self.self_attention(x, x, x, attn_mask=x_mask, query_lengths=x_length_mask, key_lengths=x_length_mask)
        x = self.norm1(x)
        y = self.dropout(self.activation(self.ff1(x)))
        y = self.dropout(self.ff2(y))
        return self.norm2(x + y)


class Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            EncoderBlock(d_model=config['d_model'], d_inner=config.get('d_inner'), n_heads=config.get('n_heads'),
                         self_attention_type=config['self_attention_type'], is_decoder=config['is_decoder'],
                         dropout=config['dropout'], activation=config['activation'])
            for _ in range(config['n_layers']))
        self.norm = nn.LayerNorm(config['d_model']) if config['final_norm'] else None

    def forward(self, x, x_mask=None, x_length_mask=None):
        h = x
        for layer in self.layers:
            h = layer(h, x_mask, x_length_mask)
        if self.norm is not None:
            h = self.norm(h)
        return h


# ---------------- midi_transformer/modules/emb.py, head.py ----------------
class Embeddings(nn.Module):
    def __init__(self, n_token, d_emb):
        super().__init__()
        self.lut = nn.Embedding(n_token, d_emb)
        self.d_emb = d_emb

    def forward(self, x):
        return self.lut(x) * math.sqrt(self.d_emb)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=512):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer('pe', pe.unsqueeze(0))

    def forward(self, x):
        return self.pe[:, :x.size(1), :]


class CPEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.emb_layers = nn.ModuleDict([[k, Embeddings(config['n_tokens'][k], config['emb_dims'][k])]
                                         for k in config['attributes']])
        sum_emb_dims = sum(config['emb_dims'].values())
        self.proj = nn.Linear(sum_emb_dims, config['d_model']) if config['d_model'] != sum_emb_dims else None
        self.pos_emb = PositionalEncoding(d_model=config['d_model'], max_len=config['max_len'])
        self.dropout = nn.Dropout(p=config['dropout'])

    def forward(self, x):
        embs = torch.cat([self.emb_layers[k](x[..., i]) for i, k in enumerate(self.emb_layers)], dim=-1)
        if self.proj is not None:
            embs = self.proj(embs)
        return self.dropout(embs + self.pos_emb(embs))


class CPHeadLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        heads = []
        for k in config['attributes']:
            d = config['emb_dims']['ttype'] if k != 'ttype' else 0
            heads += [[k, nn.Linear(config['d_model'] + d, config['n_tokens'][k])]]
        self.heads = nn.ModuleDict(heads)
        self.type_emb = None

    def register_embeddings(self, type_emb):
        self.type_emb = type_emb

    def forward(self, h, y):
        logits = {'ttype': self.heads['ttype'](h)}
        y_type = self.type_emb(y[..., 0])
        h_ext = torch.cat([h, y_type], dim=-1)
        for k in self.config['attributes'][1:]:
            logits[k] = self.heads[k](h_ext)
        return OrderedDict(logits)


# ---------------- midi_transformer/model.py ----------------
class CPTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.criterion = nn.CrossEntropyLoss(reduction='none')
        self.emb = CPEmbedding(config['embedding'])
        self.encoder = Encoder(config['encoder'])
        self.head = CPHeadLayer(config['head'])
        self.head.register_embeddings(self.emb.emb_layers['ttype'])

    def forward(self, x, x_length_mask=None, y=None):
        h = self.emb(x)
        h = self.encoder(h, x_length_mask=x_length_mask)
        return self.head(h, y)

    def calculate_loss(self, logits, labels):
        losses = {}
        mask = torch.zeros_like(labels)
        mask[:, :, 0] = 1.
        for i in [1, 2, 3]:
            mask[:, :, i] = (labels[:, :, 0] == 0)
        for i in [4, 5, 6, 7]:
            mask[:, :, i] = (labels[:, :, 0] == 1)
        for i, k in enumerate(logits.keys()):
            l = self.criterion(logits[k].transpose(1, 2), labels[..., i]) * mask[..., i]
            s = torch.sum(mask[..., i])
            losses[k] = torch.mean(torch.sum(l) / s if s > 0. else torch.sum(l))
        return losses

    def step(self, batch):
        logits = self.forward(x=batch['X'], x_length_mask=batch['X_len'], y=batch['labels'])
        losses = self.calculate_loss(logits, batch['labels'].long())
        return sum(losses.values()) / len(logits)


def random_cp(B, T):
    cols = [torch.randint(0, n_tokens[k], (B, T + 1)) for k in attributes]
    cols[0] = torch.randint(0, 2, (B, T + 1))
    return torch.stack(cols, dim=-1)


if __name__ == "__main__":
    model = CPTransformer(config)
    B, T = 2, 16
    seq = random_cp(B, T)
    batch = {'X': seq[:, :-1], 'labels': seq[:, 1:], 'X_len': torch.full((B,), T, dtype=torch.long)}

    # one training step as CPTransformer.training_step does
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    loss = model.step(batch)
    opt.zero_grad()
    loss.backward()
    opt.step()

    # teacher-forced logits at position t vs. the same model run on the prefix [:t+1] only
    model.eval()
    with torch.no_grad():
        full = model(batch['X'], batch['X_len'], batch['labels'])
        maxdiff = 0.0
        for t in range(T):
            pre = model(batch['X'][:, :t + 1], torch.full((B,), t + 1, dtype=torch.long), batch['labels'][:, :t + 1])
            for k in attributes:
                maxdiff = max(maxdiff, (full[k][:, t] - pre[k][:, t]).abs().max().item())
    print("self_attention_type:", config['encoder']['self_attention_type'])
    print(f"train loss: {loss.item():.4f}")
    print(f"max |logits(full seq)[t] - logits(prefix[:t+1])[t]|: {maxdiff:.6e}")
