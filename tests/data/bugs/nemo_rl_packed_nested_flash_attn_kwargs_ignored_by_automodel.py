"""NeMo RL sequence packing: boundaries nested in flash_attn_kwargs never reach an Automodel attention.

Citation: NVIDIA-NeMo/RL#4167 ("Packed Nemotron sequences attend across trajectory boundaries in
FSDP2/AutoModel"), same root cause as NVIDIA-NeMo/RL#2105 ("cu_seqlens not propagated to AutoModel");
fix proposed in NVIDIA-NeMo/RL#4215 ("plumb packing boundaries as top-level cu_seqlens", open when read).
I read the issue texts and the PR description, not the code; names follow those texts, the bodies are mine.

Bug: NeMo RL packs several trajectories into one [1, T] row and passes the boundaries the HF FA2 way, as a
single nested kwarg: model(input_ids, position_ids, flash_attn_kwargs=FlashAttentionKwargs(cu_seqlens_q=...,
...)). Automodel's Nemotron attention only reads top-level cu_seqlens / qkv_format ("thd") through
preprocess_args_and_kwargs_for_attn, so the nested kwarg is ignored and the packed row is one causal
sequence: every trajectory attends the ones packed before it.

Fix: in _build_model_batch, when the model expects the native packing contract, promote the nested
metadata to top-level cu_seqlens / cu_seqlens_q / cu_seqlens_kv, max_seqlen and qkv_format="thd".

This program: the packing helper, the batch builder, and an Automodel-style model whose attention, given
qkv_format="thd" and cu_seqlens, attends within each packed sequence (a torch rendering of the varlen
kernel: block-diagonal causal mask into F.scaled_dot_product_attention), else is causal over the row.
"""
import inspect
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class FlashAttentionKwargs:
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def get_flash_attention_kwargs(input_lengths):
    cu_seqlens = F.pad(torch.cumsum(input_lengths, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(input_lengths.max())
    return FlashAttentionKwargs(cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)


def pack_sequences(sequences):
    input_ids = torch.cat(sequences).unsqueeze(0)
    position_ids = torch.cat([torch.arange(len(s)) for s in sequences]).unsqueeze(0)
    input_lengths = torch.tensor([len(s) for s in sequences])
    return input_ids, position_ids, get_flash_attention_kwargs(input_lengths)


def preprocess_args_and_kwargs_for_attn(q, k, v, **attn_kwargs):
    if attn_kwargs.get("qkv_format") == "thd" and attn_kwargs.get("cu_seqlens") is not None:
        cu_seqlens = attn_kwargs["cu_seqlens"]
        seq_len = q.shape[-2]
        seq_idx = torch.bucketize(torch.arange(seq_len), cu_seqlens[1:], right=True)
        attn_mask = (seq_idx[:, None] == seq_idx[None, :]) & torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        return {"attn_mask": attn_mask, "is_causal": False}
    return {"attn_mask": None, "is_causal": True}


class NemotronV3Attention(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4):
        super().__init__()
        self.num_heads, self.head_dim = num_attention_heads, hidden_size // num_attention_heads
        self.qkv_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, **attn_kwargs):
        bsz, seq_len, _ = hidden_states.shape
        q, k, v = self.qkv_proj(hidden_states).view(bsz, seq_len, 3, self.num_heads, self.head_dim).permute(
            2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, **preprocess_args_and_kwargs_for_attn(q, k, v, **attn_kwargs))
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class NemotronV3ForCausalLM(nn.Module):
    def __init__(self, vocab_size=64, hidden_size=32, num_layers=2, max_positions=32):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.embed_positions = nn.Embedding(max_positions, hidden_size)
        self.layers = nn.ModuleList(NemotronV3Attention(hidden_size) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, qkv_format=None, **attn_kwargs):
        h = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        for layer in self.layers:
            h = h + layer(h, cu_seqlens=cu_seqlens, qkv_format=qkv_format)
        return self.lm_head(h)


def _expects_native_packing(model):
    params = inspect.signature(model.forward).parameters
    return any(name in params for name in ("cu_seqlens", "cu_seqlens_q", "cu_seqlens_kv"))


def _build_model_batch(model, input_ids, position_ids, flash_attn_kwargs):
    model_args = {"input_ids": input_ids, "position_ids": position_ids, "flash_attn_kwargs": flash_attn_kwargs}
    if FIXED and _expects_native_packing(model):
        nested = model_args.pop("flash_attn_kwargs")
        model_args.update(cu_seqlens=nested.cu_seqlens_q, cu_seqlens_q=nested.cu_seqlens_q,
                          cu_seqlens_kv=nested.cu_seqlens_k, max_seqlen=nested.max_seqlen_q, qkv_format="thd")
    return model_args


def main():
    torch.manual_seed(0)
    model = NemotronV3ForCausalLM()
    trajectories = [torch.tensor([3, 9, 14, 22, 5]), torch.tensor([7, 30, 11]), torch.tensor([12, 40, 2, 19])]
    input_ids, position_ids, flash_attn_kwargs = pack_sequences(trajectories)
    with torch.no_grad():
        logits = model(**_build_model_batch(model, input_ids, position_ids, flash_attn_kwargs))
    logprobs = logits[:, :-1].log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    print("cu_seqlens", flash_attn_kwargs.cu_seqlens_q.tolist())
    print("logprob of trajectory 2's second token %.4f" % logprobs[0, 5].item())


if __name__ == "__main__":
    main()
