# NVIDIA/TransformerEngine#818 (commit 67bc399d, "[PyTorch/Jax] Fix attention mask definition, and sliding
# window for decoder"). transformer_engine/pytorch/attention.py: DotProductAttention with attn_mask_type="padding"
# takes a bool padding mask [b, 1, 1, s] in which True = masked out (the Megatron / TE-JAX convention that
# attention_mask_func's masked_fill uses). Its FlashAttention backend unpads q, k, v for flash_attn_varlen_func
# with get_cu_seqlens_and_indices(mask), which before the fix summed the mask and took mask.nonzero(): it counted
# the True (pad) slots as the sequence and packed the pad positions. The fix reads mask.logical_not() there.
# Ported to CPU: flash_attn_varlen_func is a plain-torch loop over the cu_seqlens segments, float32, device of
# the mask instead of "cuda"; pack/unpack and the FlashAttention.forward padding branch as TE wrote them.
import sys
import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def get_cu_seqlens_and_indices(mask):
    mask = mask.squeeze(1).squeeze(1)
    bs, seqlen = mask.shape
    if FIXED:
        reduced_mask = mask.logical_not().sum(dim=1)
    else:
        reduced_mask = mask.sum(dim=1)
    cu_seqlens = reduced_mask.cumsum(dim=0).to(torch.int32)
    zero = torch.zeros(1, dtype=torch.int32, device=mask.device)
    cu_seqlens = torch.cat((zero, cu_seqlens))

    mask = mask.reshape(-1)
    if FIXED:
        indices = mask.logical_not().nonzero()
    else:
        indices = mask.nonzero()
    indices = indices.unsqueeze(-1)

    num_nonzeros = indices.shape[0]
    pad_amount = bs * seqlen - num_nonzeros
    indices = F.pad(input=indices, pad=(0, 0, 0, 0, 0, pad_amount),
                    mode="constant", value=float(bs * seqlen))
    return cu_seqlens, indices


def pack_tensor(indices, tensor):
    padding_indice = torch.zeros(
        1, tensor.shape[1], tensor.shape[2], dtype=tensor.dtype, device=tensor.device)
    tensor = torch.cat((tensor, padding_indice), dim=0)
    indices = indices.repeat(1, tensor.shape[1], tensor.shape[2])
    packed = torch.gather(tensor, 0, indices)
    return packed


def unpack_tensor(indices, dim0, tensor):
    indices = indices.repeat(1, tensor.shape[1], tensor.shape[2])
    unpacked = torch.zeros(
        dim0 + 1, tensor.shape[1], tensor.shape[2], dtype=tensor.dtype, device=tensor.device)
    unpacked.scatter_(0, indices, tensor)
    unpacked = unpacked[0:-1, :, :]
    return unpacked


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p, softmax_scale=None, causal=False):
    # [total, h, d] in, [total, h, d] out; rows past cu_seqlens_q[-1] are left as allocated
    out = torch.zeros_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if qe == qs or ke == ks:
            continue
        qb, kb, vb = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
        s = torch.matmul(qb, kb.transpose(-2, -1)) * softmax_scale
        if causal:
            s = s.masked_fill(torch.ones(qe - qs, ke - ks, dtype=torch.bool).triu(1), float("-inf"))
        out[qs:qe] = torch.matmul(s.softmax(-1), vb).transpose(0, 1)
    return out


class FlashAttention(torch.nn.Module):
    def __init__(self, norm_factor, attention_dropout=0.0, attention_type="self"):
        super().__init__()
        self.norm_factor = norm_factor
        self.attention_dropout = attention_dropout
        self.attention_type = attention_type

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None,
                qkv_layout="bshd_bshd_bshd", attn_mask_type="padding"):
        qkv_format = ''.join([i for i in qkv_layout.split('_')[0] if i.isalpha()])
        query_layer, key_layer, value_layer = [x.contiguous()
                                               for x in (query_layer, key_layer, value_layer)]
        batch_size = query_layer.shape[0]
        max_seqlen_q, max_seqlen_kv = query_layer.shape[1], key_layer.shape[1]
        query_layer, key_layer, value_layer = [
            x.view(x.shape[0] * x.shape[1], *x.shape[2:])
            for x in [query_layer, key_layer, value_layer]
        ]
        if 'padding' in attn_mask_type:
            assert max_seqlen_q == max_seqlen_kv
            assert attention_mask is not None, "Please provide attention_mask for padding!"
            cu_seqlens_q, indices_q = get_cu_seqlens_and_indices(attention_mask)
            cu_seqlens_kv = cu_seqlens_q
            query_layer, key_layer, value_layer = [
                pack_tensor(indices_q, x) for x in (query_layer, key_layer, value_layer)]
        output = flash_attn_varlen_func(
            query_layer, key_layer, value_layer,
            cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
            self.attention_dropout if self.training else 0.0,
            softmax_scale=1.0 / self.norm_factor, causal="causal" in attn_mask_type)
        if 'padding' in attn_mask_type:
            output = unpack_tensor(indices_q, batch_size * max_seqlen_q, output)
        if qkv_format == 'bshd':
            output = output.view(batch_size, max_seqlen_q, -1).contiguous()
        return output


class SelfAttentionLayer(torch.nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4):
        super().__init__()
        self.h = num_attention_heads
        self.d = hidden_size // num_attention_heads
        self.qkv = torch.nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = torch.nn.Linear(hidden_size, hidden_size)
        self.core_attention = FlashAttention(norm_factor=self.d ** 0.5)

    def forward(self, hidden_states, attention_mask):
        b, s, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, s, 3, self.h, self.d).unbind(2)
        ctx = self.core_attention(q, k, v, attention_mask=attention_mask,
                                  qkv_layout="bshd_bshd_bshd", attn_mask_type="padding")
        return hidden_states + self.proj(ctx)


def main():
    pad_id, vocab, hidden = 0, 50, 32
    lengths = [6, 4, 2]
    seqlen = 6
    input_ids = torch.zeros(len(lengths), seqlen, dtype=torch.long)
    for i, n in enumerate(lengths):
        input_ids[i, :n] = torch.randint(1, vocab, (n,))
    # [b, 1, 1, s] bool, True = masked out
    attention_mask = (input_ids == pad_id).unsqueeze(1).unsqueeze(1)

    emb = torch.nn.Embedding(vocab, hidden)
    layers = torch.nn.ModuleList([SelfAttentionLayer(hidden) for _ in range(2)])
    head = torch.nn.Linear(hidden, 3)
    with torch.no_grad():
        x = emb(input_ids)
        for layer in layers:
            x = layer(x, attention_mask)
        keep = (~attention_mask.squeeze(1).squeeze(1)).unsqueeze(-1).float()
        pooled = (x * keep).sum(1) / keep.sum(1)
        logits = head(pooled)
    print("pooled[:, :4]:", pooled[:, :4])
    print("logits:", logits)
    print("pred:", logits.argmax(-1).tolist())


if __name__ == "__main__":
    main()
