"""YOCO self-decoder: the sliding-window attention hands flash_attn_func the new chunk's keys only.

Citation: microsoft/unilm#1612 ("Maybe some bugs of YOCO"), fixed by commit f4f7b27 ("fix swa",
merged as PR #1614, merge commit 53ed1159). Ported from YOCO/yoco/models/decoder/
sliding_window_attention.py, yoco.py (YOCOArgs, DecoderLayer, SelfDecoder, CrossDecoder, YOCO),
cross_attention.py, rms_norm.py, feedforward_network.py and criterions/needle_haystack.py (generate).

Bug: SlidingWindowAttention.forward builds `key` / `value` from its incremental_state (the cached
window plus the new chunk) but then calls `flash_attn_func(q, k, v, causal=True, window_size=(
self.window_size - 1, 0))` with the chunk's own `k`, `v`. At decode (one query token) each
self-decoder layer attends to the new token alone. Also `self.window_size = args.sliding_window - 1`
was already a radius, so the `- 1` at the call made the prefill window one key shorter than stated.

Fix: `self.window_size = args.sliding_window`; `else: key, value = k, v` and the kernel is handed
`key`, `value`.

flash_attn_func is GPU only; it is replaced by a CPU stand-in with FlashAttention-2's documented
semantics (q/k/v as (batch, seqlen, nheads, headdim); causal aligned to the bottom-right corner; a
query at i attends keys [i + Lk - Lq - window_size[0], i + Lk - Lq + window_size[1]]; -1 = no bound;
fewer kv heads are shared by groups of query heads). Megatron's parallel linears are nn.Linear
(model_parallel_size = 1), flash_attn's rotary and the swiglu jiterator are written in torch.
"""
import math
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- flash_attn stand-ins (CPU)
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1)):
    bsz, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    if nheads_k != nheads:
        k = k.repeat_interleave(nheads // nheads_k, dim=2)
        v = v.repeat_interleave(nheads // nheads_k, dim=2)
    if causal:
        window_size = (window_size[0], 0)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * softmax_scale
    row = torch.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    col = torch.arange(seqlen_k)[None, :]
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if window_size[0] >= 0:
        allowed &= col >= row - window_size[0]
    if window_size[1] >= 0:
        allowed &= col <= row + window_size[1]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.float())
    return out.to(q.dtype).contiguous()


def apply_rotary_emb(x, cos, sin, interleaved=False):
    ro_dim = cos.shape[-1] * 2
    x_ro, x_pass = x[..., :ro_dim], x[..., ro_dim:]
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    if interleaved:
        x1, x2 = x_ro[..., 0::2], x_ro[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x1 * sin + x2 * cos
        out = torch.stack((o1, o2), dim=-1).flatten(-2)
    else:
        x1, x2 = x_ro.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((out, x_pass), dim=-1)


def swiglu(x, y):
    return F.silu(x) * y


# ---------------------------------------------------------------- YOCO modules
@dataclass
class YOCOArgs:
    dim: int
    n_layers: int
    hidden_dim: int
    n_self_heads: int
    n_attn_heads: int
    n_attn_kv_heads: int
    vocab_size: int

    max_batch_size: int = 0
    max_seq_len: int = -1
    model_parallel_size: int = 1
    load_checkpoint: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    sliding_window: Optional[int] = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


class FeedForwardNetwork(nn.Module):
    def __init__(self, embed_dim, ffn_dim, load_checkpoint=False):
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, ffn_dim, bias=False)
        self.gate = nn.Linear(embed_dim, ffn_dim, bias=False)
        self.fc2 = nn.Linear(ffn_dim, embed_dim, bias=False)

    def forward(self, x):
        x_shape = x.shape
        x = x.reshape(-1, x.size(-1))
        x = self.fc2(swiglu(self.fc1(x), self.gate(x)))
        return x.view(x_shape)


class SlidingWindowAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.embed_dim = args.dim
        self.num_heads = args.n_self_heads // args.model_parallel_size
        if FIXED:
            self.window_size = args.sliding_window
        else:
            self.window_size = args.sliding_window - 1  # compatible with flash attention
        self.head_dim = args.dim // args.n_self_heads
        self.q_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.out_proj = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x, rel_pos, start_pos=0, incremental_state=None):
        bsz, tgt_len, embed_dim = x.size()
        src_len = tgt_len

        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)

        q = q.view(bsz, tgt_len, self.num_heads, self.head_dim)
        k = k.view(bsz, src_len, self.num_heads, self.head_dim)
        v = v.view(bsz, src_len, self.num_heads, self.head_dim)

        q = apply_rotary_emb(q, *rel_pos, interleaved=True)
        k = apply_rotary_emb(k, *rel_pos, interleaved=True)
        if incremental_state is not None:
            if "prev_key" not in incremental_state:
                incremental_state["prev_key"] = torch.empty(self.args.max_batch_size, self.window_size, self.num_heads, self.head_dim, device=x.device, dtype=x.dtype)
                incremental_state["prev_value"] = torch.empty(self.args.max_batch_size, self.window_size, self.num_heads, self.head_dim, device=x.device, dtype=x.dtype)

            key = torch.cat([incremental_state["prev_key"][:bsz, :start_pos], k], dim=1)
            value = torch.cat([incremental_state["prev_value"][:bsz, :start_pos], v], dim=1)
            if key.shape[1] > self.window_size:
                incremental_state["prev_key"][:bsz] = key[:, -self.window_size:]
                incremental_state["prev_value"][:bsz] = value[:, -self.window_size:]
            else:
                incremental_state["prev_key"][:bsz, start_pos: start_pos + tgt_len] = k
                incremental_state["prev_value"][:bsz, start_pos: start_pos + tgt_len] = v
        else:
            key, value = k, v
        if FIXED:
            attn = flash_attn_func(q, key, value, causal=True, window_size=(self.window_size - 1, 0))
        else:
            attn = flash_attn_func(q, k, v, causal=True, window_size=(self.window_size - 1, 0))
        attn = attn.reshape(bsz, tgt_len, self.head_dim * self.num_heads)

        attn = self.out_proj(attn)
        return attn


class CrossAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.num_heads = args.n_attn_heads // args.model_parallel_size
        self.num_kv_heads = args.n_attn_kv_heads // args.model_parallel_size
        self.head_dim = args.dim // args.n_attn_heads
        self.q_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.out_proj = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x, key, value, rel_pos):
        bsz, tgt_len, _ = x.size()
        q = self.q_proj(x)
        q = q.view(bsz, tgt_len, self.num_heads, self.head_dim)
        q = apply_rotary_emb(q, *rel_pos, interleaved=True)

        attn = flash_attn_func(q, key, value, causal=True)
        attn = attn.view(bsz, tgt_len, self.head_dim * self.num_heads)
        return self.out_proj(attn)


class DecoderLayer(nn.Module):
    def __init__(self, args: YOCOArgs, is_cross_layer=False):
        super().__init__()
        self.args = args
        self.is_cross_layer = is_cross_layer
        if is_cross_layer:
            self.mixer = CrossAttention(args)
        elif args.sliding_window is not None:
            self.mixer = SlidingWindowAttention(args)
        else:
            raise NotImplementedError("gate retention is not ported")
        self.mixer_layer_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn = FeedForwardNetwork(args.dim, args.hidden_dim, args.load_checkpoint)
        self.final_layer_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, start_pos=0, key=None, value=None, rel_pos=None, incremental_state=None, is_prefilling=False):
        residual = x
        x = self.mixer_layer_norm(x)
        if self.is_cross_layer:
            x = self.mixer(x, key, value, rel_pos=rel_pos)
        else:
            x = self.mixer(x, rel_pos=rel_pos, start_pos=start_pos, incremental_state=incremental_state)
        x = x + residual
        residual = x
        x = self.final_layer_norm(x)
        x = self.ffn(x)
        return x + residual


class SelfDecoder(nn.Module):
    def __init__(self, args: YOCOArgs):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList([DecoderLayer(args, is_cross_layer=False) for _ in range(args.n_layers // 2)])
        self.head_dim = args.dim // args.n_self_heads
        self.block_size = 256
        self._precomputed_freqs_cis = None

    def build_rel_pos(self, x, start_pos):
        if self._precomputed_freqs_cis is None:
            angle = 1.0 / (self.args.rope_theta ** torch.linspace(0, 1, self.head_dim // 2, dtype=torch.float, device=x.device))
            index = torch.arange(self.args.max_seq_len).to(angle)
            self._precomputed_freqs_cis = index[:, None] * angle
        cos = torch.cos(self._precomputed_freqs_cis[start_pos:start_pos + x.size(1)])
        sin = torch.sin(self._precomputed_freqs_cis[start_pos:start_pos + x.size(1)])
        return (cos.to(x.dtype), sin.to(x.dtype))

    def get_index_mask(self, x, length, pad_length):
        return torch.arange(pad_length, device=x.device) >= length

    def forward(self, x, incremental_state=None, is_prefilling=False, start_pos=0):
        if is_prefilling and x.size(1) % self.block_size != 0 and self.args.sliding_window is None:
            padding_len = self.block_size - x.size(1) % self.block_size
            x = F.pad(x, (0, 0, 0, padding_len), value=0)
        else:
            padding_len = 0

        if incremental_state is not None and is_prefilling:
            index_mask = self.get_index_mask(x, x.size(1) - padding_len, x.size(1))

        rel_pos = self.build_rel_pos(x, start_pos)
        for idx, layer in enumerate(self.layers):
            if incremental_state is not None:
                if idx not in incremental_state:
                    incremental_state[idx] = {}
                if is_prefilling:
                    incremental_state[idx]["index_mask"] = index_mask
            x = layer(x, start_pos=start_pos, rel_pos=rel_pos,
                      incremental_state=incremental_state[idx] if incremental_state is not None else None,
                      is_prefilling=is_prefilling)
        x = x[:, :x.size(1) - padding_len, :]
        return x


class CrossDecoder(nn.Module):
    def __init__(self, args: YOCOArgs):
        super().__init__()
        self.args = args
        self.num_heads = args.n_attn_kv_heads
        self.head_dim = args.dim // args.n_attn_heads
        self.k_proj = nn.Linear(args.dim, self.head_dim * args.n_attn_kv_heads, bias=False)
        self.v_proj = nn.Linear(args.dim, self.head_dim * args.n_attn_kv_heads, bias=False)
        self.kv_layer_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(args, is_cross_layer=True) for _ in range(args.n_layers // 2)])
        self._precomputed_freqs_cis = None

    def build_rel_pos(self, x, start_pos):
        if self._precomputed_freqs_cis is None:
            angle = 1.0 / (self.args.rope_theta ** torch.linspace(0, 1, self.head_dim // 2, dtype=torch.float, device=x.device))
            index = torch.arange(self.args.max_seq_len).to(angle)
            self._precomputed_freqs_cis = index[:, None] * angle
        cos = torch.cos(self._precomputed_freqs_cis[start_pos:start_pos + x.size(1)])
        sin = torch.sin(self._precomputed_freqs_cis[start_pos:start_pos + x.size(1)])
        return (cos.to(x.dtype), sin.to(x.dtype))

    def forward(self, x, incremental_state=None, start_pos=0, skip_cross_decoder=False):
        bsz, seqlen, embed_dim = x.size()
        x_norm = self.kv_layer_norm(x)
        key, value = self.k_proj(x_norm), self.v_proj(x_norm)
        key = key.view(bsz, seqlen, self.num_heads, self.head_dim)
        value = value.view(bsz, seqlen, self.num_heads, self.head_dim)
        rel_pos = self.build_rel_pos(x, start_pos)
        key = apply_rotary_emb(key, *rel_pos, interleaved=True)
        if incremental_state is not None:
            if "prev_key" not in incremental_state:
                incremental_state["prev_key"] = torch.empty(bsz, self.args.max_seq_len, self.num_heads, self.head_dim, device=x.device, dtype=x.dtype)
                incremental_state["prev_value"] = torch.empty(bsz, self.args.max_seq_len, self.num_heads, self.head_dim, device=x.device, dtype=x.dtype)
            incremental_state["prev_key"][:, start_pos: start_pos + seqlen] = key
            incremental_state["prev_value"][:, start_pos: start_pos + seqlen] = value
            key = incremental_state["prev_key"][:, : start_pos + seqlen]
            value = incremental_state["prev_value"][:, : start_pos + seqlen]

        if skip_cross_decoder:
            return torch.zeros(bsz, 1, embed_dim, device=x.device, dtype=x.dtype)
        for layer in self.layers:
            x = layer(x, key=key, value=value, rel_pos=rel_pos)
        return x


class YOCO(nn.Module):
    def __init__(self, args: YOCOArgs):
        super().__init__()
        self.args = args
        self.embed_scale = math.sqrt(args.dim)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.output_projection = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.self_decoder = SelfDecoder(args)
        self.cross_decoder = CrossDecoder(args)
        self.layer_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, start_pos=0, incremental_state=None, is_prefilling=True, skip_cross_decoder=False):
        x = self.embed_scale * self.embed_tokens(x)
        x = self.self_decoder(x, incremental_state=incremental_state, is_prefilling=is_prefilling, start_pos=start_pos)
        x = self.cross_decoder(x, start_pos=start_pos, incremental_state=incremental_state, skip_cross_decoder=skip_cross_decoder)
        x = self.layer_norm(x)
        return self.output_projection(x), None


# ---------------------------------------------------------------- needle_haystack.generate
class Tokenizer:
    pad_id, bos_id, eos_id = 0, 1, 2


def generate(model, tokenizer, net_input, generate_tokens=8, chunk_length=32768):
    output_tokens = torch.cat((net_input, torch.full((net_input.shape[0], generate_tokens), tokenizer.pad_id).long()), dim=1)
    begin_pad_index = torch.where(output_tokens == tokenizer.pad_id)[1].min().item()
    incremental_state = {}
    eos_reached = torch.tensor([False] * net_input.shape[0])
    # prefilling
    for begin_index in range(0, begin_pad_index - 1, chunk_length):
        end_index = min(begin_index + chunk_length, begin_pad_index - 1)
        _, _ = model(output_tokens[:, begin_index: end_index], incremental_state=incremental_state, start_pos=begin_index, skip_cross_decoder=True, is_prefilling=True)
    # generation
    step_logits = []
    for index in range(begin_pad_index, output_tokens.shape[1]):
        generation_net_output, _ = model(output_tokens[:, index - 1].unsqueeze(-1), incremental_state=incremental_state, start_pos=index - 1, skip_cross_decoder=False, is_prefilling=False)
        generation_net_output[:, :, tokenizer.bos_id] = -math.inf
        generation_net_output[:, :, tokenizer.pad_id] = -math.inf
        step_logits.append(generation_net_output[:, -1, :])
        next_tokens = torch.argmax(generation_net_output[:, -1, :], dim=-1)
        pad_tokens = output_tokens[:, index]
        next_tokens = torch.where((pad_tokens == tokenizer.pad_id) & ~eos_reached, next_tokens, pad_tokens)
        output_tokens[:, index] = next_tokens
        eos_reached |= next_tokens == tokenizer.eos_id
        if all(eos_reached):
            break
    return output_tokens, torch.stack(step_logits, dim=1)


def main():
    torch.manual_seed(0)
    args = YOCOArgs(dim=32, n_layers=4, hidden_dim=64, n_self_heads=4, n_attn_heads=4, n_attn_kv_heads=2,
                    vocab_size=48, max_batch_size=1, max_seq_len=64, sliding_window=4)
    model = YOCO(args).eval()
    tokenizer = Tokenizer()
    prompts = [
        [tokenizer.bos_id, 11, 23, 5, 37, 19, 8, 30, 14, 41, 26],
        [tokenizer.bos_id, 7, 7, 44, 12, 3, 29, 35, 16],
    ]
    with torch.no_grad():
        for prompt in prompts:
            prompt_tokens = torch.tensor([prompt])
            output, logits = generate(model, tokenizer, prompt_tokens)
            print("prompt:", prompt)
            print("generated:", output[0, prompt_tokens.shape[1]:].tolist())
            print("first-step logits[:6]:", [round(v, 4) for v in logits[0, 0, 3:9].tolist()])


if __name__ == "__main__":
    main()
