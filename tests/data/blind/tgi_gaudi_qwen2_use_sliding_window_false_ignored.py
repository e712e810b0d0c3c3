"""TGI Gaudi backend: Qwen2 sliding window applied although use_sliding_window is false.

Citation: huggingface/text-generation-inference#3280 ("[gaudi] Gemma3 sliding
window support", squash-merged as 429dcd9c); the fix is the PR-branch commit
99323542 ("qwen2 sliding window fix, mllama does not contain sliding window"),
read in the upstream git history (backends/gaudi/server/text_generation_server/...).
Provenance caveat: the buggy state exists on that PR's branch (commit 8c988de9
made the HPU attention honour window_size_left; 99323542 fixed Qwen2 two commits
later, before the squash merge). On main before #3280 the HPU attention ignored
window_size_left, so released builds never ran this banded mask.

Bug: Qwen2 checkpoints ship `sliding_window` together with
`use_sliding_window: false` (the window is disabled). The Gaudi
`Qwen2Attention` set `self.max_past = config.sliding_window` and
`FlashCausalLM.__init__` only nulled `config.sliding_window` when it was
missing, so prefill built `seqlen.make_sliding_window_bias(...)` and ran the
fused SDPA with that banded mask instead of plain causal attention: prompt
tokens further back than `sliding_window` were hidden.

Fix: `max_past = config.sliding_window if config.use_sliding_window and
config.sliding_window is not None else -1`, and `FlashCausalLM` sets
`config.sliding_window = None` when `use_sliding_window` is False.

This program: the Gaudi prefill path in plain torch. The batch is left padded
to the longest prompt (as the HPU backend does), `Seqlen.make_sliding_window_bias`
is TGI's code, and `FusedSDPA` (habana) is replaced by a torch port of its
arguments (attn_mask, or is_causal with valid_sequence_lengths and
padding_side="left") calling `F.scaled_dot_product_attention`. The config is a
Qwen2 config.json as TGI reads it; the window is shrunk to 4 (real checkpoints
carry 32768/131072) so that the 9-token prompt exceeds it.
"""
import sys
from typing import List, Optional

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Qwen2Config:
    """Fields of a Qwen2 config.json that TGI reads."""

    def __init__(self, **kw):
        self.hidden_size = kw.get("hidden_size", 32)
        self.num_attention_heads = kw.get("num_attention_heads", 4)
        self.num_key_value_heads = kw.get("num_key_value_heads", 2)
        self.num_hidden_layers = kw.get("num_hidden_layers", 1)
        self.vocab_size = kw.get("vocab_size", 64)
        self.sliding_window = kw.get("sliding_window")
        self.use_sliding_window = kw.get("use_sliding_window", False)
        self.max_window_layers = kw.get("max_window_layers", 28)


class FusedSDPA:
    """Torch port of habana FusedSDPA.apply's masking arguments."""

    @staticmethod
    def apply(query, key, value, attn_mask, dropout_p, is_causal, scale, softmax_mode,
              recompute_mode, valid_sequence_lengths, padding_side):
        q_len, k_len = query.shape[-2], key.shape[-2]
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, 1)
        value = value.repeat_interleave(groups, 1)
        if attn_mask is None:
            mask = torch.ones(query.shape[0], 1, q_len, k_len, dtype=torch.bool)
            if is_causal:
                mask &= torch.ones(q_len, k_len, dtype=torch.bool).tril()
            if valid_sequence_lengths is not None:
                assert padding_side == "left"
                start = (k_len - valid_sequence_lengths).view(-1, 1, 1, 1)
                keep = torch.arange(k_len).view(1, 1, 1, -1) >= start
                mask &= keep
            attn_mask = mask
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale)


class Seqlen:
    def __init__(self, input_lengths):
        self.input_lengths = input_lengths
        self.attn_mask = None

    def make_sliding_window_bias(self, seq_lens: List[int], window_size: Optional[int], dtype,
                                 padded_input_len: Optional[int], padded_bs: Optional[int]):
        attn_biases = []
        for seq_len in seq_lens:
            if seq_len != 0:
                tensor = torch.full((1, seq_len, seq_len), dtype=dtype, fill_value=1)
                shift = 0
                mask = torch.tril(tensor, diagonal=shift).to(dtype)
                if window_size is not None:
                    mask = torch.triu(mask, diagonal=shift - window_size + 1)
                mask = F.pad(mask, (padded_input_len - seq_len, 0, padded_input_len - seq_len, 0, 0, 0), value=0)
            else:
                mask = torch.full((1, padded_input_len, padded_input_len), dtype=dtype, fill_value=0)
            attn_biases.append(mask)
        attn_biases = torch.stack(attn_biases, dim=0)
        return attn_biases.to(torch.bool)


def attention(*, query, key, value, seqlen, softmax_scale, window_size_left=-1, causal=True):
    bs = seqlen.input_lengths.shape[0]
    _, head_num, head_size = query.shape
    _, kv_head_num, head_size = key.shape
    query = query.view(bs, -1, head_num, head_size).transpose(1, 2)
    key = key.view(bs, -1, kv_head_num, head_size).transpose(1, 2)
    value = value.view(bs, -1, kv_head_num, head_size).transpose(1, 2)
    attn_output = FusedSDPA.apply(
        query, key, value,
        seqlen.attn_mask if window_size_left != -1 else None,
        0.0,
        causal if window_size_left == -1 else False,
        softmax_scale,
        "None",
        None,
        seqlen.input_lengths if window_size_left == -1 else None,
        "left",
    )
    return attn_output.transpose(1, 2).reshape(-1, head_num, head_size)


class Qwen2Attention(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        if FIXED:
            self.max_past = (
                config.sliding_window if config.use_sliding_window and config.sliding_window is not None else -1
            )
        else:
            self.max_past = config.sliding_window if config.sliding_window is not None else -1
        self.num_heads = config.num_attention_heads
        self.head_size = config.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.softmax_scale = self.head_size ** -0.5
        self.query_key_value = torch.nn.Linear(
            config.hidden_size, self.head_size * (self.num_heads + 2 * self.num_key_value_heads)
        )
        self.o_proj = torch.nn.Linear(self.num_heads * self.head_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, seqlen):
        qkv = self.query_key_value(hidden_states)
        query, kv = qkv.split([self.head_size * self.num_heads, 2 * self.head_size * self.num_key_value_heads], dim=1)
        query = query.view(-1, self.num_heads, self.head_size)
        kv = kv.view(-1, 2, self.num_key_value_heads, self.head_size)
        attn_output = attention(
            query=query, key=kv[:, 0], value=kv[:, 1], seqlen=seqlen,
            softmax_scale=self.softmax_scale, window_size_left=self.max_past,
        )
        return self.o_proj(attn_output.view(-1, self.num_heads * self.head_size))


class FlashCausalLM:
    def __init__(self, config):
        if getattr(config, "sliding_window", None) is None:
            config.sliding_window = None
        if FIXED:
            if getattr(config, "use_sliding_window", True) is False:
                config.sliding_window = None
        self.sliding_window = config.sliding_window
        self.dtype = torch.float32
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.self_attn = Qwen2Attention(config)

    def forward_prefill(self, input_ids, input_lengths):
        batch_size = input_lengths.shape[0]
        prompt_len = input_ids.shape[0] // batch_size
        seqlen = Seqlen(input_lengths=input_lengths)
        if self.sliding_window is not None:
            seqlen.attn_mask = seqlen.make_sliding_window_bias(
                input_lengths.tolist(), self.sliding_window, self.dtype, prompt_len, batch_size
            )
        return self.self_attn(self.embed_tokens(input_ids), seqlen)


def main():
    torch.manual_seed(0)
    # config.json of a Qwen2 checkpoint: the window is present but disabled.
    config = Qwen2Config(sliding_window=4, use_sliding_window=False, max_window_layers=28)
    model = FlashCausalLM(config)
    pad_token_id = 0
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25]]
    prompt_len = max(len(p) for p in prompts)
    # HPU batches are left padded to the bucket length.
    input_ids = torch.tensor([[pad_token_id] * (prompt_len - len(p)) + p for p in prompts]).view(-1)
    input_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    with torch.no_grad():
        out = model.forward_prefill(input_ids, input_lengths).view(len(prompts), prompt_len, -1)
    valid = sum(out[i, prompt_len - n:].sum() for i, n in enumerate(input_lengths.tolist()))
    print("fixed" if FIXED else "buggy", "prefill output checksum:", round(float(valid), 4))


if __name__ == "__main__":
    main()
