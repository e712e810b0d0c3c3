"""HunyuanVideo `attention(mode="vanilla")` ignored cu_seqlens, so video tokens attended text padding.

Citation: Tencent-Hunyuan/HunyuanVideo PR #310 ("Fix vanilla and torch attention cu_seqlens
handling", addressing the quality degradation of issue #296).  Open PR; its description was
read, the diff was not.  The surrounding code (`get_cu_seqlens`, `MEMORY_LAYOUT`, the vanilla
branch) is written from HunyuanVideo's hyvideo/modules/attention.py and models.py as published.

Bug: the double-stream blocks concatenate [img tokens | text tokens (padded to text_len)] per
sample and describe the valid part only through `cu_seqlens_q/kv` (2*B+1 entries: a valid
segment then a padding segment per sample) for `flash_attn_varlen_func`.  The `vanilla` mode
builds `attn_bias` from `causal` / `attn_mask` only (both unset here) and never looks at
`cu_seqlens`, so every image/text token attends to the text padding tokens too.
Fix (PR #310): in vanilla mode, build a block-diagonal mask from `cu_seqlens_q/kv` so a token
attends only inside its own segment.

Reproduction: batch of 2, img_len=4, text padded to 3 with real lengths [3, 1]; the double
stream attention runs in mode="vanilla" (softmax over q @ k^T + attn_bias).
"""
import math
import sys

import torch

FIXED = "--fixed" in sys.argv

MEMORY_LAYOUT = {
    "torch": (lambda x: x.transpose(1, 2), lambda x: x.transpose(1, 2)),
    "vanilla": (lambda x: x.transpose(1, 2), lambda x: x.transpose(1, 2)),
}


def get_cu_seqlens(text_mask, img_len):
    """Calculate cu_seqlens_q, cu_seqlens_kv using text_mask and img_len."""
    batch_size = text_mask.shape[0]
    text_len = text_mask.sum(dim=1)
    max_len = text_mask.shape[1] + img_len
    cu_seqlens = torch.zeros([2 * batch_size + 1], dtype=torch.int32)
    for i in range(batch_size):
        s = text_len[i] + img_len
        s1 = i * max_len + s
        s2 = (i + 1) * max_len
        cu_seqlens[2 * i + 1] = s1
        cu_seqlens[2 * i + 2] = s2
    return cu_seqlens


def _varlen_block_mask(cu_seqlens_q, cu_seqlens_kv, b, s, s1):
    """Boolean [b, 1, s, s1]: True where query and key fall in the same cu_seqlens segment."""
    seg_q = torch.bucketize(torch.arange(b * s), cu_seqlens_q[1:], right=True).view(b, s)
    seg_k = torch.bucketize(torch.arange(b * s1), cu_seqlens_kv[1:], right=True).view(b, s1)
    return (seg_q[:, :, None] == seg_k[:, None, :])[:, None]


def attention(q, k, v, mode="vanilla", drop_rate=0, attn_mask=None, causal=False,
              cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, batch_size=1):
    pre_attn_layout, post_attn_layout = MEMORY_LAYOUT[mode]
    q = pre_attn_layout(q)
    k = pre_attn_layout(k)
    v = pre_attn_layout(v)
    if mode == "vanilla":
        scale_factor = 1 / math.sqrt(q.size(-1))
        b, a, s, _ = q.shape
        s1 = k.size(2)
        attn_bias = torch.zeros(b, a, s, s1, dtype=q.dtype, device=q.device)
        if causal:
            assert attn_mask is None, "Causal mask and attn_mask cannot be used together"
            temp_mask = torch.ones(b, a, s, s, dtype=torch.bool, device=q.device).tril(diagonal=0)
            attn_bias.masked_fill_(temp_mask.logical_not(), float("-inf"))
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_bias.masked_fill_(attn_mask.logical_not(), float("-inf"))
            else:
                attn_bias += attn_mask
        if FIXED and cu_seqlens_q is not None and cu_seqlens_kv is not None:
            same_segment = _varlen_block_mask(cu_seqlens_q, cu_seqlens_kv, b, s, s1)
            attn_bias.masked_fill_(same_segment.logical_not(), float("-inf"))
        attn = (q @ k.transpose(-2, -1)) * scale_factor
        attn += attn_bias
        attn = attn.softmax(dim=-1)
        attn = torch.dropout(attn, p=drop_rate, train=True)
        x = attn @ v
    else:
        raise NotImplementedError(f"Unsupported attention mode: {mode}")
    x = post_attn_layout(x)
    b, s, a, d = x.shape
    return x.reshape(b, s, -1)


def main():
    torch.manual_seed(0)
    heads, head_dim, img_len = 2, 8, 4
    text_mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    batch, txt_len = text_mask.shape
    img_q, img_k, img_v = (torch.randn(batch, img_len, heads, head_dim) for _ in range(3))
    txt_q, txt_k, txt_v = (torch.randn(batch, txt_len, heads, head_dim) for _ in range(3))
    q = torch.cat((img_q, txt_q), dim=1)
    k = torch.cat((img_k, txt_k), dim=1)
    v = torch.cat((img_v, txt_v), dim=1)
    cu_seqlens_q = get_cu_seqlens(text_mask, img_len)
    cu_seqlens_kv = get_cu_seqlens(text_mask, img_len)
    max_seqlen_q = img_len + txt_len
    attn = attention(q, k, v, mode="vanilla", cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                     max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_q, batch_size=batch)
    img_attn = attn[:, :img_len]
    print("cu_seqlens", cu_seqlens_q.tolist(), "img_attn[1,0,:3] =", [round(x, 4) for x in img_attn[1, 0, :3].tolist()])


if __name__ == "__main__":
    main()
