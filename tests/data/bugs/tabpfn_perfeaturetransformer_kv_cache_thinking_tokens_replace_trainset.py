# TabPFN (PriorLabs/TabPFN#852, commit 7437cf7): in fit_mode="fit_with_cache" the thinking tokens were added again at
# prediction time, which bumps single_eval_pos from 0 to num_thinking_rows, so the test rows attend to the fresh thinking
# rows only (and overwrite the cached train-set K/V) instead of attending to the cached train-set representation.
import sys
import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, nhead):
        super().__init__()
        self.nhead, self.d_k = nhead, d_model // nhead
        self.w_q = nn.Linear(d_model, d_model, bias=False)
        self.w_kv = nn.Linear(d_model, 2 * d_model, bias=False)
        self.w_out = nn.Linear(d_model, d_model, bias=False)
        self._k_cache = None
        self._v_cache = None

    @property
    def has_cached_kv(self):
        return self._k_cache is not None

    def empty_kv_cache(self):
        self._k_cache = self._v_cache = None

    def forward(self, x, x_kv=None, *, cache_kv=False, use_cached_kv=False, add_input=False):
        # x: [..., seq_q, d], x_kv: [..., seq_kv, d]; dim -2 is the sequence dimension
        assert not (cache_kv and use_cached_kv)
        x_kv = x if x_kv is None else x_kv
        *lead, sq, d = x.shape
        q = self.w_q(x).view(*lead, sq, self.nhead, self.d_k).transpose(-2, -3)
        if use_cached_kv:
            k, v = self._k_cache, self._v_cache
        else:
            skv = x_kv.shape[-2]
            kv = self.w_kv(x_kv).view(*lead, skv, 2, self.nhead, self.d_k)
            k, v = kv[..., 0, :, :].transpose(-2, -3), kv[..., 1, :, :].transpose(-2, -3)
        if cache_kv:
            self._k_cache, self._v_cache = k, v
        attn = F.scaled_dot_product_attention(q, k, v)
        out = self.w_out(attn.transpose(-2, -3).reshape(*lead, sq, d))
        return x + out if add_input else out


class PerFeatureEncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_ff):
        super().__init__()
        self.self_attn_between_features = MultiHeadAttention(d_model, nhead)
        self.self_attn_between_items = MultiHeadAttention(d_model, nhead)
        self.mlp = nn.Sequential(nn.Linear(d_model, dim_ff), nn.GELU(), nn.Linear(dim_ff, d_model))
        self.layer_norms = nn.ModuleList([nn.LayerNorm(d_model) for _ in range(3)])
        self.multiquery_item_attention_for_test_set = False

    def forward(self, state, single_eval_pos, *, cache_trainset_representation=False):
        # state: [batch, items, feature blocks, d_model]
        if cache_trainset_representation and not single_eval_pos:
            assert self.self_attn_between_items.has_cached_kv

        def attn_between_features(x):
            return self.self_attn_between_features(x, add_input=True)

        def attn_between_items(x):
            attention_src_x = None
            if single_eval_pos:
                attention_src_x = x[:, :single_eval_pos].transpose(1, 2)
            return self.self_attn_between_items(
                x.transpose(1, 2),
                attention_src_x,
                cache_kv=bool(cache_trainset_representation and single_eval_pos),
                add_input=True,
                use_cached_kv=bool(cache_trainset_representation and not single_eval_pos),
            ).transpose(1, 2)

        for sublayer, ln in zip([attn_between_features, attn_between_items, lambda x: x + self.mlp(x)], self.layer_norms):
            state = ln(sublayer(state))
        return state


class AddThinkingTokens(nn.Module):
    def __init__(self, num_thinking_rows, emsize):
        super().__init__()
        self.num_thinking_rows = num_thinking_rows
        self.row_token_values = nn.Parameter(torch.randn(num_thinking_rows, emsize))

    def forward(self, embedded_input, single_eval_pos):
        batch_size, _, num_features, _ = embedded_input.shape
        thinking_tokens = self.row_token_values.unsqueeze(0).unsqueeze(2).expand(batch_size, -1, num_features, -1)
        embedded_input = torch.cat([thinking_tokens, embedded_input], dim=1)
        single_eval_pos += self.num_thinking_rows
        return embedded_input, single_eval_pos


class PerFeatureTransformer(nn.Module):
    def __init__(self, emsize=32, nhead=4, nlayers=2, features_per_group=2, num_thinking_rows=4, n_out=3,
                 cache_trainset_representation=False):
        super().__init__()
        self.features_per_group = features_per_group
        self.encoder = nn.Linear(features_per_group, emsize)
        self.y_encoder = nn.Linear(1, emsize)
        self.layers = nn.ModuleList([PerFeatureEncoderLayer(emsize, nhead, 2 * emsize) for _ in range(nlayers)])
        self.add_thinking_tokens = AddThinkingTokens(num_thinking_rows, emsize)
        self.decoder = nn.Linear(emsize, n_out)
        self.cache_trainset_representation = cache_trainset_representation

    def forward(self, x, y):
        # x: [items, batch, features], y: [train items, batch] or None (KV-cache prediction)
        seq_len, batch, nfeat = x.shape
        training_targets_provided = y is not None and y.shape[0] > 0
        single_eval_pos = y.shape[0] if y is not None else 0
        x = x.view(seq_len, batch, nfeat // self.features_per_group, self.features_per_group)
        embedded_x = self.encoder(x).transpose(0, 1)  # b s f e
        y_full = torch.zeros(seq_len, batch)
        if training_targets_provided:
            y_full[:single_eval_pos] = y
        embedded_y = self.y_encoder(y_full.unsqueeze(-1)).transpose(0, 1)  # b s e
        embedded_input = torch.cat((embedded_x, embedded_y.unsqueeze(2)), dim=2)

        if FIXED:
            is_kv_cache_prediction = self.cache_trainset_representation and single_eval_pos == 0
            # The thinking tokens are added when the cache is populated, so we don't add them again when using the cache.
            add = self.add_thinking_tokens is not None and not is_kv_cache_prediction
        else:
            add = self.add_thinking_tokens is not None
        if add:
            embedded_input, single_eval_pos = self.add_thinking_tokens(embedded_input, single_eval_pos)

        encoder_out = embedded_input
        for layer in self.layers:
            encoder_out = layer(encoder_out, single_eval_pos,
                                cache_trainset_representation=self.cache_trainset_representation)
        test_encoder_out = encoder_out[:, single_eval_pos:, -1].transpose(0, 1)
        return self.decoder(test_encoder_out)


n_train, n_test, batch, nfeat = 10, 6, 2, 4
X = torch.randn(n_train + n_test, batch, nfeat)
y_train = torch.randint(0, 3, (n_train, batch)).double()

model = PerFeatureTransformer().eval()
with torch.no_grad():
    # fit_mode="fit_preprocessors": train and test rows go through the model together
    ref = model(X, y_train)
    # fit_mode="fit_with_cache": fit() fills the train-set K/V cache, predict() runs the test rows alone
    model.cache_trainset_representation = True
    model(X[:n_train], y_train)
    cached = model(X[n_train:], None)
    for layer in model.layers:
        layer.self_attn_between_items.empty_kv_cache()

print(f"max |fit_with_cache - fit_preprocessors| test logits: {(cached - ref).abs().max().item():.3e}")
