"""STORM world model (weipu-zhang/STORM), shrunk: a post-LN transformer over one
token per timestep ([stochastic latent z_t ; one-hot a_t] through a stem).

Training and acting use the full sequence with get_subsequent_mask: a bool
(1, L, L) lower triangle, unsqueezed for the head axis, applied with
masked_fill(mask == 0, -1e9).  Imagination uses forward_with_kv_cache: the
per-layer cache holds each layer's *input* features (not projected K/V); the new
token's input is appended to the cache and the layer attends from the new token
to the whole cache under get_vector_mask, a (1, 1, L+1) all-ones mask, with the
positional embedding taken at the cache length.

Ported from weipu-zhang/STORM:
  sub_models/attention_blocks.py @129e862f76f67a6211f0e57668aadded4d82193d
      (get_subsequent_mask, get_subsequent_mask_with_batch_length, get_vector_mask,
       ScaledDotProductAttention, MultiHeadAttention, PositionwiseFeedForward,
       AttentionBlockKVCache, PositionalEncoding1D.forward / forward_with_position)
  sub_models/transformer_model.py @911bdcadb027a1adb8ad64a178527fed665493d9
      (StochasticTransformerKVCache.forward, reset_kv_cache_list, forward_with_kv_cache)
  sub_models/world_models.py @40cc5239e52d8399803d09ed3276d0e939d00359
      (calc_last_dist_feat, predict_next, imagine_data: context fed one step at a
       time through the cache, then imagined steps)
The distribution heads are reduced to one linear prior head; sampling uses
OneHotCategorical as in stright_throught_gradient.  float64, CPU, no autocast.

Checks (all must match):
  1. training forward with the subsequent mask == a per-query loop over keys j <= i;
  2. the cached imagination (context + imagined steps, one token per call) ==
     one full forward over the same latents/actions with the subsequent mask,
     at every step; calc_last_dist_feat on the context == the last cached feature
     of the context phase.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import OneHotCategorical

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


# ------------------------------------------------------------ attention_blocks.py
def get_subsequent_mask(seq):
    batch_size, batch_length = seq.shape[:2]
    subsequent_mask = (1 - torch.triu(torch.ones((1, batch_length, batch_length), device=seq.device), diagonal=1)).bool()
    return subsequent_mask


def get_subsequent_mask_with_batch_length(batch_length, device):
    subsequent_mask = (1 - torch.triu(torch.ones((1, batch_length, batch_length), device=device), diagonal=1)).bool()
    return subsequent_mask


def get_vector_mask(batch_length, device):
    mask = torch.ones((1, 1, batch_length), device=device).bool()
    return mask


class ScaledDotProductAttention(nn.Module):
    def __init__(self, temperature, attn_dropout=0.1):
        super().__init__()
        self.temperature = temperature
        self.dropout = nn.Dropout(attn_dropout)

    def forward(self, q, k, v, mask=None):
        attn = torch.matmul(q / self.temperature, k.transpose(2, 3))
        if mask is not None:
            attn = attn.masked_fill(mask == 0, -1e9)
        attn = self.dropout(F.softmax(attn, dim=-1))
        output = torch.matmul(attn, v)
        return output, attn


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, d_model, d_k, d_v, dropout=0.1):
        super().__init__()
        self.n_head, self.d_k, self.d_v = n_head, d_k, d_v
        self.w_qs = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_ks = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_vs = nn.Linear(d_model, n_head * d_v, bias=False)
        self.fc = nn.Linear(n_head * d_v, d_model, bias=False)
        self.attention = ScaledDotProductAttention(temperature=d_k ** 0.5)
        self.dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, q, k, v, mask=None):
        d_k, d_v, n_head = self.d_k, self.d_v, self.n_head
        sz_b, len_q, len_k, len_v = q.size(0), q.size(1), k.size(1), v.size(1)
        residual = q
        q = self.w_qs(q).reshape(sz_b, len_q, n_head, d_k)
        k = self.w_ks(k).reshape(sz_b, len_k, n_head, d_k)
        v = self.w_vs(v).reshape(sz_b, len_v, n_head, d_v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if mask is not None:
            mask = mask.unsqueeze(1)  # For head axis broadcasting.
        q, attn = self.attention(q, k, v, mask=mask)
        q = q.transpose(1, 2).contiguous().reshape(sz_b, len_q, -1)
        q = self.dropout(self.fc(q))
        q += residual
        q = self.layer_norm(q)
        return q, attn


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_in, d_hid, dropout=0.1):
        super().__init__()
        self.w_1 = nn.Linear(d_in, d_hid)
        self.w_2 = nn.Linear(d_hid, d_in)
        self.layer_norm = nn.LayerNorm(d_in, eps=1e-6)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        residual = x
        x = self.w_2(F.relu(self.w_1(x)))
        x = self.dropout(x)
        x += residual
        return self.layer_norm(x)


class AttentionBlockKVCache(nn.Module):
    def __init__(self, feat_dim, hidden_dim, num_heads, dropout):
        super().__init__()
        self.slf_attn = MultiHeadAttention(num_heads, feat_dim, feat_dim // num_heads, feat_dim // num_heads, dropout=dropout)
        self.pos_ffn = PositionwiseFeedForward(feat_dim, hidden_dim, dropout=dropout)

    def forward(self, q, k, v, slf_attn_mask=None):
        output, attn = self.slf_attn(q, k, v, mask=slf_attn_mask)
        output = self.pos_ffn(output)
        return output, attn


class PositionalEncoding1D(nn.Module):
    def __init__(self, max_length, embed_dim):
        super().__init__()
        self.max_length = max_length
        self.pos_emb = nn.Embedding(max_length, embed_dim)

    def forward(self, feat):
        pos_emb = self.pos_emb(torch.arange(self.max_length, device=feat.device))
        pos_emb = pos_emb.unsqueeze(0).expand(feat.shape[0], -1, -1)
        return feat + pos_emb[:, :feat.shape[1], :]

    def forward_with_position(self, feat, position):
        assert feat.shape[1] == 1
        pos_emb = self.pos_emb(torch.arange(self.max_length, device=feat.device))
        pos_emb = pos_emb.unsqueeze(0).expand(feat.shape[0], -1, -1)
        return feat + pos_emb[:, position:position + 1, :]


# ----------------------------------------------------------- transformer_model.py
class StochasticTransformerKVCache(nn.Module):
    def __init__(self, stoch_dim, action_dim, feat_dim, num_layers, num_heads, max_length, dropout):
        super().__init__()
        self.action_dim = action_dim
        self.feat_dim = feat_dim
        self.kv_cache_list = []
        self.stem = nn.Sequential(
            nn.Linear(stoch_dim + action_dim, feat_dim, bias=False), nn.LayerNorm(feat_dim), nn.ReLU(inplace=True),
            nn.Linear(feat_dim, feat_dim, bias=False), nn.LayerNorm(feat_dim))
        self.position_encoding = PositionalEncoding1D(max_length=max_length, embed_dim=feat_dim)
        self.layer_stack = nn.ModuleList([
            AttentionBlockKVCache(feat_dim=feat_dim, hidden_dim=feat_dim * 2, num_heads=num_heads, dropout=dropout)
            for _ in range(num_layers)])
        self.layer_norm = nn.LayerNorm(feat_dim, eps=1e-6)

    def embed(self, samples, action):
        action = F.one_hot(action.long(), self.action_dim).to(samples.dtype)
        return self.stem(torch.cat([samples, action], dim=-1))

    def forward(self, samples, action, mask):
        feats = self.embed(samples, action)
        feats = self.position_encoding(feats)
        feats = self.layer_norm(feats)
        for layer in self.layer_stack:
            feats, attn = layer(feats, feats, feats, mask)
        return feats

    def reset_kv_cache_list(self, batch_size, dtype):
        self.kv_cache_list = []
        for layer in self.layer_stack:
            self.kv_cache_list.append(torch.zeros(size=(batch_size, 0, self.feat_dim), dtype=dtype))

    def forward_with_kv_cache(self, samples, action):
        assert samples.shape[1] == 1
        mask = get_vector_mask(self.kv_cache_list[0].shape[1] + 1, samples.device)
        feats = self.embed(samples, action)
        feats = self.position_encoding.forward_with_position(feats, position=self.kv_cache_list[0].shape[1])
        feats = self.layer_norm(feats)
        for idx, layer in enumerate(self.layer_stack):
            self.kv_cache_list[idx] = torch.cat([self.kv_cache_list[idx], feats], dim=1)
            feats, attn = layer(feats, self.kv_cache_list[idx], self.kv_cache_list[idx], mask)
        return feats


# ------------------------------------------------------------------ world_models.py
class TinyWorldModel(nn.Module):
    def __init__(self, stoch_dim, action_dim, max_length, hidden_dim, num_layers, num_heads):
        super().__init__()
        self.stoch_dim = stoch_dim
        self.stoch_flattened_dim = stoch_dim * stoch_dim
        self.storm_transformer = StochasticTransformerKVCache(
            stoch_dim=self.stoch_flattened_dim, action_dim=action_dim, feat_dim=hidden_dim,
            num_layers=num_layers, num_heads=num_heads, max_length=max_length, dropout=0.1)
        self.prior_head = nn.Linear(hidden_dim, self.stoch_flattened_dim)

    def sample_latent(self, dist_feat):
        logits = self.prior_head(dist_feat).reshape(*dist_feat.shape[:2], self.stoch_dim, self.stoch_dim)
        sample = OneHotCategorical(logits=logits).sample()
        return sample.reshape(*dist_feat.shape[:2], -1)

    def calc_last_dist_feat(self, latent, action):
        temporal_mask = get_subsequent_mask(latent)
        dist_feat = self.storm_transformer(latent, action, temporal_mask)
        return dist_feat[:, -1:]

    def predict_next(self, last_flattened_sample, action):
        dist_feat = self.storm_transformer.forward_with_kv_cache(last_flattened_sample, action)
        return self.sample_latent(dist_feat), dist_feat

    @torch.no_grad()
    def imagine_data(self, context_latent, context_action, action_fn, imagine_batch_length):
        B = context_latent.shape[0]
        self.storm_transformer.reset_kv_cache_list(B, dtype=context_latent.dtype)
        latents, actions, feats = [], [], []
        for i in range(context_latent.shape[1]):
            last_latent, last_dist_feat = self.predict_next(context_latent[:, i:i + 1], context_action[:, i:i + 1])
            latents.append(context_latent[:, i:i + 1]); actions.append(context_action[:, i:i + 1]); feats.append(last_dist_feat)
        context_last_feat = last_dist_feat
        for i in range(imagine_batch_length):
            action = action_fn(last_latent, last_dist_feat)
            latents.append(last_latent); actions.append(action)
            last_latent, last_dist_feat = self.predict_next(last_latent, action)
            feats.append(last_dist_feat)
        return torch.cat(latents, 1), torch.cat(actions, 1), torch.cat(feats, 1), context_last_feat


# ------------------------------------------------------------------- reference
def loop_reference(tr, samples, action):
    x = tr.layer_norm(tr.position_encoding(tr.embed(samples, action)))
    B, L, D = x.shape
    for layer in tr.layer_stack:
        m = layer.slf_attn
        q = m.w_qs(x).view(B, L, m.n_head, m.d_k)
        k = m.w_ks(x).view(B, L, m.n_head, m.d_k)
        v = m.w_vs(x).view(B, L, m.n_head, m.d_v)
        y = torch.zeros(B, L, m.n_head, m.d_v)
        for i in range(L):
            s = torch.einsum('bhd,bjhd->bhj', q[:, i], k[:, :i + 1]) / m.d_k ** 0.5
            y[:, i] = torch.einsum('bhj,bjhd->bhd', torch.softmax(s, -1), v[:, :i + 1])
        x = m.layer_norm(m.fc(y.reshape(B, L, -1)) + x)
        x = layer.pos_ffn(x)
    return x


def main():
    stoch_dim, action_dim, hidden = 4, 3, 16
    wm = TinyWorldModel(stoch_dim, action_dim, max_length=16, hidden_dim=hidden, num_layers=2, num_heads=2).eval()
    tr = wm.storm_transformer
    ok_all = True

    # 1. training forward (world-model update) with the subsequent mask
    B, L = 3, 6
    latent = F.one_hot(torch.randint(0, stoch_dim, (B, L, stoch_dim)), stoch_dim).double().reshape(B, L, -1)
    action = torch.randint(0, action_dim, (B, L))
    with torch.no_grad():
        feats = tr(latent, action, get_subsequent_mask_with_batch_length(L, latent.device))
        ref = loop_reference(tr, latent, action)
    ok1 = torch.allclose(feats, ref, atol=1e-10)
    print('training forward with the subsequent mask matches per-query loop:', ok1)
    ok_all &= ok1

    # 2. imagination through the hidden-state cache vs one full masked forward
    torch.manual_seed(1)
    ctx_len, horizon = 4, 5
    ctx_latent = F.one_hot(torch.randint(0, stoch_dim, (B, ctx_len, stoch_dim)), stoch_dim).double().reshape(B, ctx_len, -1)
    ctx_action = torch.randint(0, action_dim, (B, ctx_len))
    gen = torch.Generator().manual_seed(2)
    action_fn = lambda z, h: torch.randint(0, action_dim, (z.shape[0], 1), generator=gen)
    lat_all, act_all, cached_feats, ctx_last = wm.imagine_data(ctx_latent, ctx_action, action_fn, horizon)
    with torch.no_grad():
        full = tr(lat_all, act_all, get_subsequent_mask(lat_all))
        acting = wm.calc_last_dist_feat(ctx_latent, ctx_action)
    ok2 = torch.allclose(cached_feats, full, atol=1e-10)
    ok2b = torch.allclose(acting, ctx_last, atol=1e-10)
    print(f'cached imagination ({ctx_len} context + {horizon} imagined steps) matches full masked forward:', ok2)
    print('calc_last_dist_feat on the context matches the last cached context feature:', ok2b)
    ok_all &= ok2 and ok2b

    print('ALL MATCH' if ok_all else 'MISMATCH')
    assert ok_all


if __name__ == '__main__':
    main()
