# knatarajan-lab/cehrgpt commit d834e07 ("enhanced is_sample_pack by deteching left padding").
# CEHR-GPT (a GPT-2 over patient timelines: demographics, visit tokens, concepts) runs its flash_attention_2 path
# on the 2-D attention_mask. `_get_unpad_data` first asks `is_sample_pack(attention_mask)`: a row is "packed" when
# it has real tokens after a 0. A left-padded batch (generation / inference, shorter patient histories padded in
# front) passes that test, so the whole batch mask is flattened and cut into segments at its zeros only: a row that
# ends in a real token and the next row that starts with one become a single varlen sequence for
# flash_attn_varlen_func, and the later patient attends the earlier patient's timeline.
# Fix: `is_sample_pack` flips a left-padded mask before testing it, so such a batch takes the per-row unpad path.
# (flash_attn's varlen kernel and bert_padding helpers written in plain torch for CPU; CEHRGPT2Model trimmed to
# embeddings + GPT-2 blocks; the config is transformers' GPT2Config, which CEHRGPTConfig extends.)
import math
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config
from transformers.activations import gelu_new
from transformers.pytorch_utils import Conv1D

FIXED = "--fixed" in sys.argv


# ---- flash_attn.bert_padding / flash_attn_varlen_func, as the kernels behave ----
def index_first_axis(x, indices):
    return x[indices]


def pad_input(hidden_states, indices, batch, seqlen):
    out = hidden_states.new_zeros((batch * seqlen,) + hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def unpad_input(hidden_states, attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return (index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens, max_seqlen_in_batch)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False):
    # q, k, v: (total_tokens, n_heads, head_dim); one attention per [cu[i], cu[i+1]) segment
    out = torch.zeros_like(q)
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        if qe == qs:
            continue
        qi, ki, vi = (t.transpose(0, 1).float() for t in (q[qs:qe], k[ks:ke], v[ks:ke]))
        # bottom-right aligned causal, as flash-attn >= 2.1
        o = F.scaled_dot_product_attention(
            qi, ki, vi, is_causal=False,
            attn_mask=torch.ones(qe - qs, ke - ks, dtype=torch.bool).tril(diagonal=(ke - ks) - (qe - qs))
            if causal else None,
            scale=softmax_scale,
        )
        out[qs:qe] = o.transpose(0, 1).to(q.dtype)
    return out


# ---- src/cehrgpt/models/hf_cehrgpt.py ----
def is_sample_pack(attention_mask: torch.Tensor) -> bool:
    """True if any sequence in the batch has real tokens after a padding token (sample packing)."""
    if FIXED:
        # If the attention_maks is left padded, we will flip it so we can use the same logic below
        if (attention_mask[:, 0] == 0).any():
            attention_mask = attention_mask.flip(dims=[1])

    nonzero_counts = attention_mask.sum(dim=1)
    max_token_positions = torch.argmax(attention_mask.flip(dims=[1]), dim=1)
    max_indices = attention_mask.shape[1] - 1 - max_token_positions
    return torch.any(nonzero_counts < (max_indices + 1)).item()


def _get_unpad_data(attention_mask):
    # This infers sample packing
    if is_sample_pack(attention_mask):
        attention_mask = attention_mask.flatten()
        nonzero = torch.nonzero(attention_mask, as_tuple=False).flatten()
        max_index = nonzero[-1].item()
        padded_attention_mask = F.pad(attention_mask[: max_index + 1], (0, 1), value=0)
        indices = torch.nonzero(attention_mask, as_tuple=False).flatten()
        # Find where 0s occur (segment boundaries)
        cumsum_seqlens_in_batch = torch.cumsum(padded_attention_mask, dim=0)[padded_attention_mask == 0]
        seqlens_in_batch = (cumsum_seqlens_in_batch - F.pad(cumsum_seqlens_in_batch, (1, 0), value=0)[:-1]).to(
            torch.int
        )
        max_seqlen_in_batch = seqlens_in_batch.max().item() if seqlens_in_batch.numel() > 0 else 0
        cu_seqlens = F.pad(cumsum_seqlens_in_batch, (1, 0)).to(torch.int)
    else:
        seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
        indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
        max_seqlen_in_batch = seqlens_in_batch.max().item()
        cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, max_seqlen_in_batch


class GPT2FlashAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.split_size = self.embed_dim
        self.is_causal = True
        self.c_attn = Conv1D(3 * self.embed_dim, self.embed_dim)
        self.c_proj = Conv1D(self.embed_dim, self.embed_dim)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def _split_heads(self, tensor, num_heads, attn_head_size):
        new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, tensor, num_heads, attn_head_size):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        return tensor.view(tensor.size()[:-2] + (num_heads * attn_head_size,))

    def forward(self, hidden_states, attention_mask: Optional[torch.Tensor] = None):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)
        attn_output = self._flash_attention_forward(
            query, key, value, attention_mask, query.size(-2), self.attn_dropout.p, softmax_scale=None
        )
        attn_output = self._merge_heads(attn_output, self.num_heads, self.head_dim)
        attn_output = self.c_proj(attn_output)
        return self.resid_dropout(attn_output)

    def _flash_attention_forward(self, query_states, key_states, value_states, attention_mask, query_length,
                                 dropout=0.0, softmax_scale=None):
        dtype = query_states.dtype
        query_states = query_states.permute(0, 2, 1, 3).contiguous().to(torch.bfloat16)
        key_states = key_states.permute(0, 2, 1, 3).contiguous().to(torch.bfloat16)
        value_states = value_states.permute(0, 2, 1, 3).contiguous().to(torch.bfloat16)
        batch_size = query_states.shape[0]
        (query_states, key_states, value_states, indices_q, cu_seq_lens, max_seq_lens) = self._upad_input(
            query_states, key_states, value_states, attention_mask, query_length
        )
        cu_seqlens_q, cu_seqlens_k = cu_seq_lens
        max_seqlen_in_batch_q, max_seqlen_in_batch_k = max_seq_lens
        attn_output_unpad = flash_attn_varlen_func(
            query_states, key_states, value_states,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_in_batch_q, max_seqlen_k=max_seqlen_in_batch_k,
            dropout_p=dropout, softmax_scale=softmax_scale, causal=True,
        )
        attn_output = pad_input(attn_output_unpad, indices_q, batch_size, query_length)
        return attn_output.permute(0, 2, 1, 3).contiguous().to(dtype)

    def _upad_input(self, query_layer, key_layer, value_layer, attention_mask, query_length):
        indices_k, cu_seqlens_k, max_seqlen_in_batch_k = _get_unpad_data(attention_mask)
        batch_size, kv_seq_len, num_key_value_heads, head_dim = key_layer.shape
        key_layer = index_first_axis(key_layer.reshape(batch_size * kv_seq_len, num_key_value_heads, head_dim),
                                     indices_k)
        value_layer = index_first_axis(value_layer.reshape(batch_size * kv_seq_len, num_key_value_heads, head_dim),
                                       indices_k)
        if query_length == kv_seq_len:
            query_layer = index_first_axis(query_layer.reshape(batch_size * kv_seq_len, self.num_heads, head_dim),
                                           indices_k)
            cu_seqlens_q = cu_seqlens_k
            max_seqlen_in_batch_q = max_seqlen_in_batch_k
            indices_q = indices_k
        else:
            attention_mask = attention_mask[:, -query_length:]
            query_layer, indices_q, cu_seqlens_q, max_seqlen_in_batch_q = unpad_input(query_layer, attention_mask)
        return (query_layer, key_layer, value_layer, indices_q, (cu_seqlens_q, cu_seqlens_k),
                (max_seqlen_in_batch_q, max_seqlen_in_batch_k))


class GPT2MLP(nn.Module):
    def __init__(self, intermediate_size, config):
        super().__init__()
        self.c_fc = Conv1D(intermediate_size, config.hidden_size)
        self.c_proj = Conv1D(config.hidden_size, intermediate_size)

    def forward(self, x):
        return self.c_proj(gelu_new(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPT2FlashAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(4 * config.hidden_size, config)

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), attention_mask=attention_mask)
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class CEHRGPT2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList([GPT2Block(config) for _ in range(config.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        batch_size = input_ids.shape[0]
        if attention_mask is not None:
            # The flash attention requires the original attention_mask
            if not getattr(self.config, "_attn_implementation", "eager") == "flash_attention_2":
                attention_mask = attention_mask.view(batch_size, -1)[:, None, None, :]
                attention_mask = (1.0 - attention_mask.float()) * torch.finfo(torch.float32).min
        hidden_states = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.h:
            hidden_states = block(hidden_states, attention_mask=attention_mask)
        return self.ln_f(hidden_states)


def main():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=40, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    config._attn_implementation = "flash_attention_2"
    model = CEHRGPT2Model(config).eval()

    pad_token_id = 0
    # two patient timelines, left padded as for generation: [START] demographics, visit start, concepts ...
    patient_a = [5, 11, 12, 3, 21, 22, 4]
    patient_b = [5, 13, 14, 3, 23, 24, 25, 4, 3, 26]
    seq_len = max(len(patient_a), len(patient_b))
    input_ids = torch.tensor([[pad_token_id] * (seq_len - len(p)) + p for p in (patient_a, patient_b)])
    attention_mask = (input_ids != pad_token_id).long()
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)

    with torch.no_grad():
        hidden = model(input_ids, attention_mask=attention_mask, position_ids=position_ids)

    print("hidden", tuple(hidden.shape))
    print("patient_a last hidden[:4]:", [round(x, 4) for x in hidden[0, -1, :4].tolist()])
    print("patient_b last hidden[:4]:", [round(x, 4) for x in hidden[1, -1, :4].tolist()])


if __name__ == "__main__":
    main()
