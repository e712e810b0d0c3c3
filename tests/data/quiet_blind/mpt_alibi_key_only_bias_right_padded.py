"""MPT (mosaicml/llm-foundry) torch attention: ALiBi as a per-KEY bias (1, H, 1, S), causal and padding separate.

Follows mosaicml/llm-foundry llmfoundry/models/layers/attention.py (gen_alibi_slopes, build_alibi_bias with
full=False, scaled_multihead_dot_product_attention: bias added to q @ k^T, `~attention_mask` and the causal tril
filled with finfo.min) and llmfoundry/models/mpt/modeling_mpt.py (MPTModel._attn_bias: a bias buffer of
max_seq_len keys, sliced to the current length, `attention_mask` applied to it; right padding for training).

Masks meant:
- ALiBi bias -m_h * (S - 1 - j): it depends on the KEY index only. Within one causal row this equals the usual
  -m_h * (i - j) plus a per-row constant, which softmax ignores, so it is the ALiBi distance penalty;
- causal: key j <= query i (finfo.min above the diagonal);
- right padding: pad keys of a row filled with finfo.min; pad query rows are ignored by the loss.
"""
import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F


def gen_alibi_slopes(n_heads, alibi_bias_max=8, device=None):
    _n_heads = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, _n_heads + 1, dtype=torch.float32, device=device)
    m = m.mul(alibi_bias_max / _n_heads)
    slopes = 1.0 / torch.pow(2, m)
    if _n_heads != n_heads:
        slopes = torch.concat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes.view(1, n_heads, 1, 1)


def build_alibi_bias(n_heads, seq_len, full=False, alibi_bias_max=8, device=None, dtype=None):
    alibi_bias = torch.arange(1 - seq_len, 1, dtype=torch.int32, device=device).view(1, 1, 1, seq_len)
    if full:
        alibi_bias = alibi_bias - torch.arange(1 - seq_len, 1, dtype=torch.int32, device=device).view(1, 1, seq_len, 1)
        alibi_bias = alibi_bias.abs().mul(-1)
    slopes = gen_alibi_slopes(n_heads, alibi_bias_max, device=device)
    return (alibi_bias * slopes).to(dtype=dtype)


def scaled_multihead_dot_product_attention(query, key, value, n_heads, softmax_scale=None, attn_bias=None,
                                           key_padding_mask=None, is_causal=False):
    b, s_q, _ = query.shape
    s_k = key.size(1)
    q = query.view(b, s_q, n_heads, -1).transpose(1, 2)
    k = key.view(b, s_k, n_heads, -1).permute(0, 2, 3, 1)
    v = value.view(b, s_k, n_heads, -1).transpose(1, 2)
    if softmax_scale is None:
        softmax_scale = 1 / math.sqrt(q.size(-1))
    attn_weight = q.matmul(k) * softmax_scale
    if attn_bias is not None:
        _s_q = max(0, attn_bias.size(2) - s_q)
        _s_k = max(0, attn_bias.size(3) - s_k)
        attn_bias = attn_bias[:, :, _s_q:, _s_k:]
        attn_weight = attn_weight + attn_bias
    min_val = torch.finfo(q.dtype).min
    if key_padding_mask is not None:
        attn_weight = attn_weight.masked_fill(~key_padding_mask.view((b, 1, 1, s_k)), min_val)
    if is_causal and (not q.size(2) == 1):
        s = max(s_q, s_k)
        causal_mask = attn_weight.new_ones(s, s, dtype=torch.float32).tril().to(torch.bool)
        causal_mask = causal_mask[-s_q:, -s_k:]
        attn_weight = attn_weight.masked_fill(~causal_mask.view(1, 1, s_q, s_k), min_val)
    attn_weight = torch.softmax(attn_weight, dim=-1)
    out = attn_weight.matmul(v)
    return out.transpose(1, 2).reshape(b, s_q, -1)


class MultiheadAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.Wqkv = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x, attn_bias=None, attention_mask=None, is_causal=True):
        query, key, value = self.Wqkv(x).chunk(3, dim=2)
        context = scaled_multihead_dot_product_attention(query, key, value, self.n_heads, attn_bias=attn_bias,
                                                         key_padding_mask=attention_mask, is_causal=is_causal)
        return self.out_proj(context)


class MPTBlock(nn.Module):
    def __init__(self, d_model, n_heads, expansion_ratio):
        super().__init__()
        self.norm_1 = nn.LayerNorm(d_model)
        self.attn = MultiheadAttention(d_model, n_heads)
        self.norm_2 = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, expansion_ratio * d_model), nn.GELU(),
                                 nn.Linear(expansion_ratio * d_model, d_model))

    def forward(self, x, attn_bias=None, attention_mask=None, is_causal=True):
        x = x + self.attn(self.norm_1(x), attn_bias=attn_bias, attention_mask=attention_mask, is_causal=is_causal)
        return x + self.ffn(self.norm_2(x))


class MPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.alibi = config.attn_config['alibi']
        self.alibi_bias_max = config.attn_config['alibi_bias_max']
        self.wte = nn.Embedding(config.vocab_size, config.d_model)  # no learned positions with ALiBi
        self.blocks = nn.ModuleList([MPTBlock(config.d_model, config.n_heads, config.expansion_ratio)
                                     for _ in range(config.n_layers)])
        self.norm_f = nn.LayerNorm(config.d_model)
        self.attn_bias_shape = (1, config.n_heads, 1, config.max_seq_len)
        self.attn_bias = None

    def _attn_bias(self, device, dtype, attention_mask=None):
        if self.attn_bias is None:
            self.attn_bias = torch.zeros(self.attn_bias_shape, device=device, dtype=dtype)
            if self.alibi:
                self.attn_bias = build_alibi_bias(self.config.n_heads, self.config.max_seq_len, full=False,
                                                  alibi_bias_max=self.alibi_bias_max, device=device, dtype=dtype)
        attn_bias = self.attn_bias
        if attention_mask is not None:
            s_k = attention_mask.shape[-1]
            attn_bias = attn_bias[:, :, :, -s_k:]
            min_val = torch.finfo(attn_bias.dtype).min
            attn_bias = attn_bias.masked_fill(~attention_mask.view(-1, 1, 1, s_k), min_val)
        return attn_bias, attention_mask

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is not None:
            attention_mask = attention_mask.bool()
            if self.training and attention_mask[:, 0].sum() != attention_mask.shape[0]:
                raise NotImplementedError('MPT does not support training with left padding.')
        x = self.wte(input_ids)
        attn_bias, attention_mask = self._attn_bias(x.device, x.dtype, attention_mask=attention_mask)
        for block in self.blocks:
            x = block(x, attn_bias=attn_bias, attention_mask=attention_mask, is_causal=True)
        return self.norm_f(x)


def main():
    torch.manual_seed(0)
    config = SimpleNamespace(d_model=32, n_heads=4, n_layers=2, expansion_ratio=4, max_seq_len=16, vocab_size=64,
                             attn_config={'alibi': True, 'alibi_bias_max': 8})
    model = MPTModel(config)
    lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
    lengths = torch.tensor([10, 6, 8])
    input_ids = torch.randint(1, 64, (3, 10))
    attention_mask = (torch.arange(10)[None, :] < lengths[:, None]).long()
    input_ids = input_ids * attention_mask  # right padding with id 0

    model.train()
    logits = lm_head(model(input_ids, attention_mask=attention_mask))
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()

    model.eval()
    with torch.no_grad():
        alone = lm_head(model(input_ids[1:2, :6]))
    # the second row, run unpadded, must match its padded run: padding is invisible
    assert torch.allclose(alone[0], logits[1, :6].detach(), atol=1e-5)
    print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
