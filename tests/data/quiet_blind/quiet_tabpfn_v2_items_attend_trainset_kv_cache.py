# Citation: PriorLabs/TabPFN src/tabpfn/model/layer.py @102eebd5d991daedc92dcea169c34b572fb4e2d6 (PerFeatureEncoderLayer)
# TabPFN v2 masks by slicing: in attn_between_items every item (train and test) queries, but keys/values come
# only from x[:, :single_eval_pos] (the training rows), so test rows never see each other. With
# cache_trainset_representation the train KV is cached on the fit call and reused when only test rows are passed
# (single_eval_pos=0, use_cached_kv). Attention between features (per item, across feature blocks) has no mask.
import torch
from torch import nn

torch.manual_seed(0)


class MultiHeadAttention(nn.Module):  # tabpfn/model/attention/full_attention.py, trimmed
    def __init__(self, emsize, nhead):
        super().__init__()
        self.nhead, self.d_k = nhead, emsize // nhead
        self.w_q = nn.Linear(emsize, emsize, bias=False)
        self.w_kv = nn.Linear(emsize, 2 * emsize, bias=False)
        self.w_out = nn.Linear(emsize, emsize, bias=False)
        self._k_cache = self._v_cache = None

    @property
    def has_cached_kv(self):
        return self._k_cache is not None

    def forward(self, x, x_kv=None, *, cache_kv=False, use_cached_kv=False, add_input=False):
        # x: (..., seq_q, emsize); x_kv: (..., seq_kv, emsize)
        x_kv = x if x_kv is None else x_kv
        q = self.w_q(x).unflatten(-1, (self.nhead, self.d_k)).transpose(-3, -2)
        if use_cached_kv:
            assert self.has_cached_kv
            k, v = self._k_cache, self._v_cache
        else:
            k, v = self.w_kv(x_kv).unflatten(-1, (2, self.nhead, self.d_k)).transpose(-4, -2).unbind(-3)
            if cache_kv:
                self._k_cache, self._v_cache = k.detach(), v.detach()
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        out = self.w_out(out.transpose(-3, -2).flatten(-2))
        return out + x if add_input else out


class PerFeatureEncoderLayer(nn.Module):
    def __init__(self, emsize=16, nhead=2, dim_feedforward=32):
        super().__init__()
        self.self_attn_between_features = MultiHeadAttention(emsize, nhead)
        self.self_attn_between_items = MultiHeadAttention(emsize, nhead)
        self.mlp = nn.Sequential(nn.Linear(emsize, dim_feedforward), nn.GELU(), nn.Linear(dim_feedforward, emsize))
        self.layer_norms = nn.ModuleList([nn.LayerNorm(emsize, elementwise_affine=False) for _ in range(3)])

    def forward(self, state, single_eval_pos=None, *, cache_trainset_representation=False):
        # state: (batch_size, num_items, num_feature_blocks, d_model)
        if single_eval_pos is None:
            single_eval_pos = 0
        if cache_trainset_representation and not single_eval_pos:
            assert self.self_attn_between_items.has_cached_kv

        def attn_between_features(x):
            return self.self_attn_between_features(x, add_input=True)

        def attn_between_items(x):
            # we need to transpose as self attention always treats dim -2 as the sequence dimension
            attention_src_x = None
            if single_eval_pos:
                attention_src_x = x[:, :single_eval_pos].transpose(1, 2)
            return self.self_attn_between_items(
                x.transpose(1, 2), attention_src_x,
                cache_kv=bool(cache_trainset_representation and single_eval_pos), add_input=True,
                use_cached_kv=bool(cache_trainset_representation and not single_eval_pos)).transpose(1, 2)

        sublayers = [attn_between_features, attn_between_items, lambda x: self.mlp(x) + x]
        for sublayer, layer_norm in zip(sublayers, self.layer_norms):  # post-norm (pre_norm=False)
            state = layer_norm(sublayer(state))
        return state


class PerFeatureTransformer(nn.Module):
    def __init__(self, features_per_group=2, emsize=16, nlayers=2, n_out=3):
        super().__init__()
        self.features_per_group = features_per_group
        self.encoder = nn.Linear(features_per_group, emsize)
        self.y_encoder = nn.Linear(1, emsize)
        self.layers = nn.ModuleList([PerFeatureEncoderLayer(emsize) for _ in range(nlayers)])
        self.decoder = nn.Linear(emsize, n_out)

    def forward(self, x, y_train, single_eval_pos, cache_trainset_representation=False):
        # x: (batch, items, features); y_train: (batch, single_eval_pos)
        b, n, f = x.shape
        emb_x = self.encoder(x.view(b, n, f // self.features_per_group, self.features_per_group))
        y = torch.zeros(b, n, 1)  # test labels are unknown; only train labels are embedded
        y[:, :single_eval_pos, 0] = y_train
        emb_y = self.y_encoder(y)[:, :, None]
        state = torch.cat([emb_x, emb_y], dim=2)  # the label is one more "feature block"
        for layer in self.layers:
            state = layer(state, single_eval_pos, cache_trainset_representation=cache_trainset_representation)
        return self.decoder(state[:, single_eval_pos:, -1])  # predictions for test items from the label block


model = PerFeatureTransformer().eval()
n_train, n_test = 12, 5
X = torch.randn(1, n_train + n_test, 4)
y_train = torch.randint(0, 3, (1, n_train)).float()
with torch.no_grad():
    full = model(X, y_train, single_eval_pos=n_train)
    # test rows never attend to other test rows: predicting one test row alone gives the same logits
    for j in range(n_test):
        Xj = torch.cat([X[:, :n_train], X[:, n_train + j:n_train + j + 1]], dim=1)
        assert torch.allclose(model(Xj, y_train, single_eval_pos=n_train)[0, 0], full[0, j], atol=1e-5)
    # fit once with the KV cache, then predict with test rows only
    _ = model(X[:, :n_train], y_train, single_eval_pos=n_train, cache_trainset_representation=True)
    cached = model(X[:, n_train:], y_train[:, :0], single_eval_pos=0, cache_trainset_representation=True)
    print("max diff full vs cached-train-KV:", (cached - full).abs().max().item())
    assert torch.allclose(cached, full, atol=1e-5)
print("test logits", full.argmax(-1).tolist())
