# LongLoRA shifted sparse attention (S2-Attn), llama_attn_replace.py forward_flashattn, as used by fine-tune.py.
# Citation: dvlab-research/LongLoRA commit 4101fec (answer to JIA-Lab-research/LongLoRA#90 "the rolling problem").
# Bug: half of the heads were shifted with qkv.roll(-group_size // 2, dims=1) and the sequence cut into groups of
# group_size; the roll wraps the first half group round to the end, so the last group of the shifted heads holds
# the last tokens followed by the first ones, and under causal=True the first tokens see the end of the sequence.
# Fix: no roll; both halves of the heads go to flash_attn_varlen_qkvpacked_func as their own rows, the shifted half
# cut into groups by cu_seqlens offset by group_size // 2 (first and last groups half size).
# flash_attn is CUDA only, so unpad_input / pad_input / flash_attn_varlen_qkvpacked_func are ported for CPU below.
import sys
import math
import warnings
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

group_size_ratio = 1 / 4


# ---- flash_attn.bert_padding / flash_attn_interface, CPU ports ----
def unpad_input(hidden_states, attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, max_seqlen_in_batch


def pad_input(hidden_states, indices, batch, seqlen):
    output = torch.zeros(batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype)
    output[indices] = hidden_states
    return output.view(batch, seqlen, *hidden_states.shape[1:])


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False):
    # qkv: (total, 3, h, d); one causal attention per [cu_seqlens[i], cu_seqlens[i + 1]) segment
    out = torch.zeros(qkv.shape[0], qkv.shape[2], qkv.shape[3], dtype=qkv.dtype)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        q, k, v = qkv[start:end].unbind(1)  # (n, h, d)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=causal, scale=softmax_scale
        )
        out[start:end] = o.transpose(0, 1)
    return out


# ---- transformers 4.33 llama helpers ----
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_position_embeddings).float()
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None, :, :], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None, :, :], persistent=False)

    def forward(self, x, seq_len=None):
        return self.cos_cached[:, :, :seq_len].to(x.dtype), self.sin_cached[:, :, :seq_len].to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, num_key_value_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.num_key_value_heads = num_key_value_heads
        self.num_key_value_groups = num_heads // num_key_value_heads
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim)


# ---- llama_attn_replace.py ----
def forward_flashattn(
    self,
    hidden_states: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    past_key_value: Optional[Tuple[torch.Tensor]] = None,
    output_attentions: bool = False,
    use_cache: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[Tuple[torch.Tensor]]]:
    """Input shape: Batch x Time x Channel

    attention_mask: [bsz, q_len]
    """
    if output_attentions:
        warnings.warn("Output attentions is not supported for patched `LlamaAttention`, returning `None` instead.")

    bsz, q_len, _ = hidden_states.size()

    query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

    kv_seq_len = key_states.shape[-2]
    cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)

    past_key_value = (key_states, value_states) if use_cache else None

    key_states = repeat_kv(key_states, self.num_key_value_groups)
    value_states = repeat_kv(value_states, self.num_key_value_groups)

    qkv = torch.stack([query_states, key_states, value_states], dim=2)  # [bsz, nh, 3, q_len, hd]
    qkv = qkv.transpose(1, 3)  # [bsz, q_len, 3, nh, hd]

    if not FIXED:
        # shift
        if self.training:
            group_size = int(q_len * group_size_ratio)
            if q_len % group_size > 0:
                raise ValueError("q_len %d should be divisible by group size %d." % (q_len, group_size))
            num_group = q_len // group_size
            qkv[:, :, :, self.num_heads // 2:] = qkv[:, :, :, self.num_heads // 2:].roll(-group_size // 2, dims=1)
            qkv = qkv.reshape(bsz * num_group, group_size, 3, self.num_heads, self.head_dim)

        # We have disabled _prepare_decoder_attention_mask in LlamaModel
        # the attention_mask should be the same as the key_padding_mask
        key_padding_mask = attention_mask[:, :group_size].repeat(num_group, 1) if self.training else attention_mask
        nheads = qkv.shape[-2]
        x = qkv.reshape(qkv.shape[0], qkv.shape[1], -1)  # "b s three h d -> b s (three h d)"
        x_unpad, indices, cu_q_lens, max_s = unpad_input(x, key_padding_mask)
        x_unpad = x_unpad.view(-1, 3, nheads, self.head_dim)  # "nnz (three h d) -> nnz three h d"
        output_unpad = flash_attn_varlen_qkvpacked_func(x_unpad, cu_q_lens, max_s, 0.0, softmax_scale=None, causal=True)
        output = pad_input(
            output_unpad.reshape(output_unpad.shape[0], -1),  # "nnz h d -> nnz (h d)"
            indices,
            bsz * num_group if self.training else bsz,
            group_size if self.training else q_len,
        )
        output = output.view(output.shape[0], output.shape[1], nheads, self.head_dim)  # "b s (h d) -> b s h d"
        output = output.reshape(bsz, q_len, self.num_heads, self.head_dim)
        if self.training:
            # shift back
            output[:, :, self.num_heads // 2:] = output[:, :, self.num_heads // 2:].roll(group_size // 2, dims=1)
    else:
        key_padding_mask = attention_mask.repeat(2, 1)
        nheads = qkv.shape[-2]
        # shift
        group_size = int(q_len * group_size_ratio)
        if q_len % group_size > 0:
            raise ValueError("q_len %d should be divisible by group size %d." % (q_len, group_size))

        qkv = qkv.reshape(bsz, q_len, 3, 2, self.num_heads // 2, self.head_dim).permute(0, 3, 1, 2, 4, 5).reshape(
            bsz * 2, q_len, 3, self.num_heads // 2, self.head_dim
        )
        x = qkv.reshape(qkv.shape[0], qkv.shape[1], -1)  # "b s three h d -> b s (three h d)"
        x_unpad, indices, cu_q_lens, max_s = unpad_input(x, key_padding_mask)
        cu_q_len_tmp = torch.arange(0, max_s, group_size, device=key_padding_mask.device, dtype=cu_q_lens.dtype)
        cu_q_len_tmp = torch.stack([cu_q_len_tmp, cu_q_len_tmp + group_size // 2]).repeat(bsz, 1) + cu_q_lens[:-1].unsqueeze(-1)
        cu_q_lens = torch.cat([cu_q_len_tmp, cu_q_lens[1:].unsqueeze(-1)], dim=-1).view(-1)

        x_unpad = x_unpad.view(-1, 3, nheads // 2, self.head_dim)  # "nnz (three h d) -> nnz three h d"
        output_unpad = flash_attn_varlen_qkvpacked_func(x_unpad, cu_q_lens, group_size, 0.0, softmax_scale=None, causal=True)
        output = pad_input(output_unpad.reshape(output_unpad.shape[0], -1), indices, bsz * 2, q_len)
        output = output.view(bsz * 2, q_len, nheads // 2, self.head_dim)  # "b s (h d) -> b s h d"
        output = output.reshape(bsz, 2, q_len, nheads // 2, self.head_dim).transpose(1, 2).reshape(
            bsz, q_len, nheads, self.head_dim
        )

    return self.o_proj(output.reshape(bsz, q_len, -1)), None, past_key_value  # "b s h d -> b s (h d)"


def replace_llama_attn(use_flash_attn=True):
    if use_flash_attn:
        LlamaAttention.forward = forward_flashattn


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden_size, num_heads, num_key_value_heads):
        super().__init__()
        self.self_attn = LlamaAttention(hidden_size, num_heads, num_key_value_heads)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 2 * hidden_size), nn.SiLU(), nn.Linear(2 * hidden_size, hidden_size))
        self.input_layernorm = LlamaRMSNorm(hidden_size)
        self.post_attention_layernorm = LlamaRMSNorm(hidden_size)

    def forward(self, hidden_states, attention_mask, position_ids):
        residual = hidden_states
        hidden_states, _, _ = self.self_attn(self.input_layernorm(hidden_states), attention_mask=attention_mask, position_ids=position_ids)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LlamaForCausalLM(nn.Module):
    def __init__(self, vocab_size=64, hidden_size=32, num_heads=4, num_key_value_heads=4, num_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(hidden_size, num_heads, num_key_value_heads) for _ in range(num_layers)])
        self.norm = LlamaRMSNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, labels=None):
        bsz, seq_len = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(bsz, seq_len, dtype=torch.bool)
        # LongLoRA disables _prepare_decoder_attention_mask: the layers get the [bsz, seq_len] mask as is
        position_ids = torch.arange(seq_len).unsqueeze(0).expand(bsz, -1)
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, position_ids)
        logits = self.lm_head(self.norm(hidden_states))
        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            loss = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
        return loss, logits


def main():
    torch.manual_seed(0)
    replace_llama_attn(use_flash_attn=True)
    model = LlamaForCausalLM()
    model.train()

    # fine-tune.py: packed RedPajama blocks of model_max_length tokens, no padding
    bsz, model_max_length = 2, 16
    input_ids = torch.randint(0, 64, (bsz, model_max_length))
    attention_mask = torch.ones(bsz, model_max_length, dtype=torch.bool)

    loss, logits = model(input_ids, attention_mask=attention_mask, labels=input_ids)
    loss.backward()
    print("S2-Attn group size:", int(model_max_length * group_size_ratio))
    print("loss:", round(loss.item(), 6))
    print("logits[0, 0, :4]:", [round(v, 5) for v in logits[0, 0, :4].tolist()])
    print("argmax at first 3 positions:", logits[0, :3].argmax(-1).tolist())


if __name__ == "__main__":
    main()
