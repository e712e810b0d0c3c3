# casper-hansen/AutoAWQ#150 (commit 958678d, "Fix condition when rolling cache"), awq/modules/fused/attn.py.
#
# AutoAWQ's fused attention (QuantAttentionFused) keeps its own WindowedCache of max_seq_len slots and a
# start_pos offset. When the cache is about to overflow, the forward rolls it: while processing a context
# (seqlen > 1) it rolls the whole cache out (reset), and while decoding (seqlen == 1) it is meant to roll out
# only 100 old tokens. Before the fix the first branch tested `will_cache_be_exceeded` alone, so a decode
# step that crossed max_seq_len took the reset branch: roll_kv_n_steps(start_pos, n=start_pos) zeroed the
# cache and set start_pos to 0, and from then on each new token attends to nothing but the tokens decoded
# after the overflow. The fix adds `and seqlen > 1` to the reset branch so decode steps roll 100 tokens.
#
# Ported from awq/modules/fused/{attn,cache,block,model}.py and awq/utils/fused_utils.py at 958678d (MPT
# path: ALiBi, n_kv_heads = 0, no ft_inference_engine so the torch path runs). The tiny MPT weights are
# random; MptConfig only carries the sizes. A greedy loop with an lm_head stands in for generate()
# (prefill, then one token at a time).
import math
import os
import sys

import torch
import torch.nn as nn
from torch.nn import functional as F
from transformers import MptConfig

FIXED = "--fixed" in sys.argv
FT_INSTALLED = False


def get_attention_shapes(attention_shapes, max_seq_len, cache_batch_size, n_heads, n_kv_heads, head_dim):
    if attention_shapes is not None:
        attention_shapes = attention_shapes
    elif n_kv_heads == 0:
        attention_shapes = {
            "cache_v": (cache_batch_size, n_heads, max_seq_len, head_dim,),
            "cache_k": (cache_batch_size, n_heads, head_dim // 8, max_seq_len, 8,),
            "xqkv_view": (-1, n_heads, head_dim),
            "xq_slice": lambda xqkv: xqkv[:, :, 0],
            "xk_slice": lambda xqkv: xqkv[:, :, 1],
            "xv_slice": lambda xqkv: xqkv[:, :, 2],
            "xq_view": (n_heads, head_dim),
            "xk_view": (n_heads, head_dim),
            "xv_view": (n_heads, head_dim),
            "xk_reshape": (n_heads, head_dim // 8, 8),
            "single_xq_view": (n_heads, head_dim),
            "single_xk_view": (n_heads, head_dim),
            "single_xv_view": (n_heads, head_dim),
        }
    return attention_shapes


class WindowedCache:
    def __init__(self, cache_v_shape, cache_k_shape, max_seq_len, device):
        # [batch_size, n_kv_heads, max_seq_len, head_dim]
        self.v = torch.zeros(cache_v_shape).to(device).half()
        # [batch_size, n_kv_heads, head_dim // pack_factor, max_seq_len, pack_factor]
        self.k = torch.zeros(cache_k_shape).to(device).half()
        self.max_seq_len = max_seq_len

    def get_kv(self, batch_size, start_pos, seqlen, head_dim):
        xv = self.v[:batch_size, :, : start_pos + seqlen, :].transpose(1, 2).contiguous()
        xk = self.k[:batch_size, :, :, : start_pos + seqlen, :].transpose(2, 3).contiguous()
        xk = xk.reshape(xk.shape[:-2] + (head_dim,)).transpose(1, 2).contiguous()
        return xv, xk

    def update_kv(self, values_store, keys_store, batch_size, start_pos, seqlen):
        self.v[:batch_size, :, start_pos : start_pos + seqlen, :] = values_store
        self.k[:batch_size, :, :, start_pos : start_pos + seqlen, :] = keys_store

    def roll_kv_n_steps(self, start_pos, n=100):
        n = min(n, self.max_seq_len)
        self.v = torch.roll(self.v, shifts=-n, dims=2)
        self.k = torch.roll(self.k, shifts=-n, dims=3)
        self.v[:, :, -n:, :] = 0
        self.k[:, :, :, -n:, :] = 0
        return start_pos - n

    def to(self, device):
        self.k = self.k.to(device)
        self.v = self.v.to(device)


class ALiBi(nn.Module):
    def __init__(self, n_heads, max_seq_len, device, alibi_bias_max=8):
        super().__init__()
        slopes, bias = self.build_alibi_bias(n_heads, max_seq_len, alibi_bias_max=alibi_bias_max)
        self.slopes = nn.Parameter(slopes.float().to(device), requires_grad=False)
        self.bias = nn.Parameter(bias.float().to(device), requires_grad=False)

    @staticmethod
    def gen_slopes(n_heads, alibi_bias_max=8):
        _n_heads = 2 ** math.ceil(math.log2(n_heads))
        m = torch.arange(1, _n_heads + 1, dtype=torch.float32)
        m = m.mul(alibi_bias_max / _n_heads)
        slopes = 1.0 / torch.pow(2, m)
        if _n_heads != n_heads:
            slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
        return slopes.view(1, n_heads, 1, 1)

    @staticmethod
    def build_alibi_bias(n_heads, seq_len, alibi_bias_max=8, dtype=torch.float32):
        alibi_bias = torch.arange(1 - seq_len, 1, dtype=torch.int32).view(1, 1, 1, seq_len)
        slopes = ALiBi.gen_slopes(n_heads, alibi_bias_max)
        alibi_bias = alibi_bias * slopes
        slopes = slopes.squeeze(0).squeeze(-1).squeeze(-1)
        return slopes.to(dtype=dtype), alibi_bias.to(dtype=dtype)

    def forward(self, scores, seqlen):
        scores += self.bias[..., :seqlen]
        return scores


class QuantAttentionFused(nn.Module):
    def __init__(self, hidden_size, n_heads, n_kv_heads, qkv_layer, o_proj, dev, max_seq_len,
                 use_alibi=False, attention_shapes=None):
        super().__init__()
        self.hidden_size = hidden_size
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.n_kv_groups = n_heads // n_kv_heads if n_kv_heads != 0 else 0
        self.head_dim = self.hidden_size // n_heads
        self.qkv_proj = qkv_layer
        self.o_proj = o_proj
        self.start_pos = 0
        self.use_alibi = use_alibi
        self.cache_batch_size = int(os.getenv("AWQ_BATCH_SIZE", "1"))
        self.max_seq_len = max_seq_len
        self.attention_shapes = get_attention_shapes(
            attention_shapes, max_seq_len, self.cache_batch_size, n_heads, n_kv_heads, self.head_dim
        )
        self.cache = WindowedCache(
            self.attention_shapes["cache_v"], self.attention_shapes["cache_k"], self.max_seq_len, dev
        )
        self.alibi = ALiBi(n_heads, max_seq_len, dev)
        self.rotary_dim = 0
        self.is_neox = False

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, *args, **kwargs):
        bsz, seqlen, _ = hidden_states.shape

        has_past_key_value = kwargs is not None and "past_key_value" in kwargs and kwargs["past_key_value"] is not None
        if has_past_key_value:
            if seqlen > 1:
                seqlen = 1
                hidden_states = hidden_states[:, -1:]

        if bsz != self.cache_batch_size:
            raise RuntimeError("Batch size is incorrectly set")

        will_cache_be_exceeded = self.start_pos + seqlen > self.max_seq_len

        # Reset and avoid retaining state when processing context
        if FIXED:
            reset = will_cache_be_exceeded and seqlen > 1
        else:
            reset = will_cache_be_exceeded
        if reset:
            self.start_pos = self.cache.roll_kv_n_steps(self.start_pos, n=self.start_pos)
        # Slowly roll out old tokens without performance hit if exceeded during decoding
        elif will_cache_be_exceeded and seqlen == 1:
            self.start_pos = self.cache.roll_kv_n_steps(self.start_pos, n=100)

        xqkv = self.qkv_proj(hidden_states)
        xqkv = xqkv.view((bsz, seqlen) + self.attention_shapes["xqkv_view"])

        xq = self.attention_shapes["xq_slice"](xqkv)
        xk = self.attention_shapes["xk_slice"](xqkv)
        xv = self.attention_shapes["xv_slice"](xqkv)

        xq = xq.view((bsz, seqlen) + self.attention_shapes["xq_view"])
        xk = xk.view((bsz, seqlen) + self.attention_shapes["xk_view"])
        xv = xv.view((bsz, seqlen) + self.attention_shapes["xv_view"])

        self.cache.to(xq)

        values_store = xv.transpose(2, 1)
        keys_store = (
            xk.reshape((bsz, seqlen) + self.attention_shapes["xk_reshape"])
            .permute(0, 2, 3, 1, 4)
            .contiguous()
        )
        self.cache.update_kv(values_store, keys_store, bsz, self.start_pos, seqlen)

        # Only necessary to retrieve from cache when we are not processing context
        if seqlen == 1:
            xv, xk = self.cache.get_kv(bsz, self.start_pos, seqlen, self.head_dim)

        keys = xk
        values = xv
        xq = xq.transpose(1, 2)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)

        if self.use_alibi:
            scores = self.alibi.forward(scores, seqlen)

        # When seqlen is 1, there is nothing else to attend to
        if attention_mask is not None and seqlen > 1:
            scores = scores + attention_mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        attention_weight = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)

        attn_output = self.o_proj(attention_weight)
        self.start_pos += seqlen

        past_key_value = [torch.Tensor([[[[0]], [[0]], [[0]]]])]
        return attn_output, attention_weight, past_key_value


class MptMLP(nn.Module):
    def __init__(self, d_model, expansion_ratio):
        super().__init__()
        self.up_proj = nn.Linear(d_model, expansion_ratio * d_model, bias=False)
        self.act = nn.GELU()
        self.down_proj = nn.Linear(expansion_ratio * d_model, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(self.act(self.up_proj(x)))


class MPTBlock(nn.Module):
    def __init__(self, hidden_size, n_heads, qkv_layer, o_proj, mpt_mlp, norm_1, norm_2, dev, max_seq_len):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = 0
        self.hidden_size = hidden_size
        self.norm_1 = norm_1
        self.attn = QuantAttentionFused(
            hidden_size, self.n_heads, self.n_kv_heads, qkv_layer, o_proj,
            dev=dev, max_seq_len=max_seq_len, use_alibi=True
        ).to(dev)
        self.norm_2 = norm_2
        self.ffn = mpt_mlp.to(dev)

    def forward(self, hidden_states, past_key_value, attn_bias=None, attention_mask=None, is_causal=None):
        norm_out = self.norm_1(hidden_states)
        attn_output, _, past_key_value = self.attn.forward(
            hidden_states=norm_out,
            past_key_value=past_key_value,
            attention_mask=attention_mask,
            position_ids=None,
            output_attentions=False,
            use_cache=True,
        )
        h = hidden_states + attn_output
        out = h + self.ffn.forward(self.norm_2(h))
        return out, None, past_key_value


class MPTModel(nn.Module):
    def __init__(self, vocab_size, blocks, wte, norm_f):
        super().__init__()
        self.vocab_size = vocab_size
        self.wte = wte
        self.blocks = nn.ModuleList(blocks)
        self.norm_f = norm_f

    @torch.inference_mode()
    def forward(self, input_ids, attn_bias=None, attention_mask=None, is_causal=None, *args, **kwargs):
        _bsz, seqlen = input_ids.shape
        h = self.wte(input_ids)

        mask = None
        if seqlen > 1:
            mask = torch.full((1, 1, seqlen, seqlen), float("-inf"), device=input_ids.device)
            mask = torch.triu(mask, diagonal=self.blocks[0].attn.start_pos + 1).type_as(h)

        for layer in self.blocks:
            h, _, past_key_value = layer(h, None, attention_mask=mask, is_causal=is_causal)
        h = self.norm_f(h)
        return h, past_key_value


def build_model(config, max_new_tokens):
    torch.manual_seed(0)
    dev = "cpu"
    blocks = []
    for _ in range(config.n_layers):
        blocks.append(MPTBlock(
            config.d_model,
            config.n_heads,
            nn.Linear(config.d_model, 3 * config.d_model, bias=False),
            nn.Linear(config.d_model, config.d_model, bias=False),
            MptMLP(config.d_model, config.expansion_ratio),
            nn.LayerNorm(config.d_model),
            nn.LayerNorm(config.d_model),
            dev,
            max_new_tokens,
        ))
    wte = nn.Embedding(config.vocab_size, config.d_model)
    transformer = MPTModel(config.vocab_size, blocks, wte, nn.LayerNorm(config.d_model))
    lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
    return transformer.eval(), lm_head.eval()


def main():
    config = MptConfig(d_model=64, n_heads=4, n_layers=2, expansion_ratio=4, vocab_size=97, max_seq_len=256)
    config.max_new_tokens = 128  # fused cache length (from_quantized(max_new_tokens=...))
    transformer, lm_head = build_model(config, config.max_new_tokens)

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (1, 110), generator=g)

    generated = []
    last_hidden = []
    with torch.inference_mode():
        h, _ = transformer(prompt)
        next_token = lm_head(h[:, -1]).argmax(-1, keepdim=True)
        for _ in range(40):
            generated.append(int(next_token))
            h, _ = transformer(next_token)
            last_hidden.append(h[:, -1].clone())
            next_token = lm_head(h[:, -1]).argmax(-1, keepdim=True)

    hidden = torch.cat(last_hidden)
    print("fixed" if FIXED else "buggy", "start_pos after generation:", transformer.blocks[0].attn.start_pos)
    print("generated:", generated)
    print("last hidden checksum: %.6f" % float(hidden.abs().sum()))


if __name__ == "__main__":
    main()
