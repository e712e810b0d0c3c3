"""AutoAWQ fused modules: a second generate() starts at the previous call's start_pos.

Citation: casper-hansen/AutoAWQ#178 (commit df909e8, "Reset cache on new generation"), for the issues
casper-hansen/AutoAWQ#154 ("Fused module cache maintains state") and #170 ("Subsequent calls to generate =
weird behaviour"); code before the fix at 5db86ec: awq/modules/fused/attn.py (QuantAttentionFused, RoPE),
awq/modules/fused/cache.py (WindowedCache), awq/modules/fused/model.py (LlamaLikeModel),
awq/modules/fused/block.py (LlamaLikeBlock), awq/utils/fused_utils.py (prepare_input_ids,
prepare_attention_mask, get_attention_shapes).

The bug: each QuantAttentionFused keeps its own ``start_pos`` into a preallocated WindowedCache and only
rolled it back when the cache would overflow (``start_pos + seqlen > max_seq_len``). A second
``generate()`` with a new prompt therefore starts where the first one stopped: the prompt's RoPE positions
begin at the old ``start_pos``, ``prepare_attention_mask`` builds ``triu(-inf, diagonal=start_pos + 1)`` over
the (seqlen, seqlen) prefill scores (no causal entries left once start_pos >= seqlen - 1), and every decode
step reads the cache from slot 0, the first conversation's keys and values included. No error is raised.

The fix: ``prepare_cache(self.blocks, seqlen)`` runs at the top of ``LlamaLikeModel.forward`` before the
mask is built, and rolls every block's cache back to ``start_pos = 0`` whenever a context (seqlen > 1) is
processed.

Ported to plain torch at toy sizes with random weights: the WQLinear_GEMM layers are nn.Linear, the
FasterTransformer RMSNorm kernel is written out, and ft_inference_engine is not installed, so decode takes
the torch path as it does without the extension. The driver calls the model the way transformers 4.35's
greedy generate does (the full context each step; ``prepare_input_ids`` keeps the new token).
"""

import math
import os
import sys

import torch
import torch.nn as nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv
FT_INSTALLED = False


# ---------------------------------------------------------------- awq/modules/fused/cache.py


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


# ---------------------------------------------------------------- awq/utils/fused_utils.py


def prepare_cache(blocks, seqlen: int) -> int:
    for block in blocks:
        start_pos = block.attn.start_pos
        will_cache_be_exceeded = start_pos + seqlen > block.attn.max_seq_len

        # Reset and avoid retaining state when processing context
        if seqlen > 1 and (will_cache_be_exceeded or seqlen > 1):
            block.attn.start_pos = block.attn.cache.roll_kv_n_steps(start_pos, n=start_pos)

        # Slowly roll out old tokens without performance hit if exceeded during decoding
        elif seqlen == 1 and will_cache_be_exceeded:
            block.attn.start_pos = block.attn.cache.roll_kv_n_steps(start_pos, n=100)


def prepare_input_ids(input_ids: torch.Tensor, last_forward_num_tokens: int):
    # NOTE: from transformers 4.35.0, input_ids includes full context during decoding
    num_input_tokens = input_ids.shape[-1]
    num_new_tokens = num_input_tokens

    if num_input_tokens != 1:
        num_new_tokens = num_input_tokens - last_forward_num_tokens

        # after context is processed, slice to latest token
        if num_new_tokens in [0, 1]:
            input_ids = input_ids[:, -1:]

    return input_ids, last_forward_num_tokens + num_new_tokens


def prepare_attention_mask(seqlen, start_pos, device, type_as: torch.Tensor):
    mask = None
    if seqlen > 1:
        mask = torch.full((1, 1, seqlen, seqlen), float("-inf"), device=device)
        mask = torch.triu(mask, diagonal=start_pos + 1).type_as(type_as)
    return mask


def get_attention_shapes(attention_shapes, max_seq_len, cache_batch_size, n_heads, n_kv_heads, head_dim):
    if attention_shapes is not None:
        attention_shapes = attention_shapes
    else:
        attention_shapes = {
            # following fastertransformer definition
            "cache_v": (cache_batch_size, n_kv_heads, max_seq_len, head_dim,),
            # 8: pack 8 fp16 in FT, if fp32 then use 4
            "cache_k": (cache_batch_size, n_kv_heads, head_dim // 8, max_seq_len, 8,),
            "xqkv_view": (n_heads + n_kv_heads * 2, head_dim),
            "xq_slice": lambda xqkv: xqkv[:, :, 0:n_heads],
            "xk_slice": lambda xqkv: xqkv[:, :, n_heads : (n_heads + n_kv_heads)],
            "xv_slice": lambda xqkv: xqkv[:, :, -n_kv_heads:],
            "xq_view": (n_heads, head_dim),
            "xk_view": (n_kv_heads, head_dim),
            "xv_view": (n_kv_heads, head_dim),
            "xk_reshape": (n_kv_heads, head_dim // 8, 8),
            "single_xq_view": (n_heads, head_dim),
            "single_xk_view": (n_kv_heads, head_dim),
            "single_xv_view": (n_kv_heads, head_dim),
        }
    return attention_shapes


# ---------------------------------------------------------------- awq/modules/fused/attn.py


class RoPE(nn.Module):
    def __init__(self, hidden_size, n_heads, max_seq_len, device):
        super(RoPE, self).__init__()
        self.freqs_cis = nn.Parameter(
            self.precompute_freqs_cis(hidden_size // n_heads, max_seq_len * 2).to(device),
            requires_grad=False,
        )

    @staticmethod
    def precompute_freqs_cis(dim: int, end: int, theta=10000.0):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        t = torch.arange(end)
        freqs = torch.outer(t, freqs).float()
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
        return freqs_cis

    @staticmethod
    def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor):
        ndim = x.ndim
        assert 0 <= 1 < ndim
        assert freqs_cis.shape == (x.shape[1], x.shape[-1])
        shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
        return freqs_cis.view(*shape)

    def forward(self, xq: torch.Tensor, xk: torch.Tensor, start_pos: int, seqlen: int):
        xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], 2, -1).transpose(-2, -1).contiguous())
        xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], 2, -1).transpose(-2, -1).contiguous())
        freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]
        freqs_cis = self.reshape_for_broadcast(freqs_cis, xq_).to(xq_.device)
        xq_out = torch.view_as_real(xq_ * freqs_cis).transpose(-2, -1).flatten(3)
        xk_out = torch.view_as_real(xk_ * freqs_cis).transpose(-2, -1).flatten(3)
        return xq_out.type_as(xq), xk_out.type_as(xk)


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
        # cache store that rolls cache
        self.cache = WindowedCache(
            self.attention_shapes["cache_v"], self.attention_shapes["cache_k"], self.max_seq_len, dev
        )
        self.alibi = None
        self.rope = RoPE(hidden_size, n_heads, max_seq_len, dev)
        self.rotary_dim = self.head_dim
        self.is_neox = True

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, *args, **kwargs):
        bsz, seqlen, _ = hidden_states.shape

        if bsz != self.cache_batch_size:
            raise RuntimeError(
                f"Batch size is incorrectly set - input batch size {bsz}, kv-cache batch size {self.cache_batch_size}. "
                f"Use: AutoAWQForCausalLM.from_quantized(batch_size={bsz})"
            )

        if not FIXED:
            will_cache_be_exceeded = self.start_pos + seqlen > self.max_seq_len

            # Reset and avoid retaining state when processing context
            if will_cache_be_exceeded and seqlen > 1:
                self.start_pos = self.cache.roll_kv_n_steps(self.start_pos, n=self.start_pos)
            # Slowly roll out old tokens without performance hit if exceeded during decoding
            elif will_cache_be_exceeded and seqlen == 1:
                self.start_pos = self.cache.roll_kv_n_steps(self.start_pos, n=100)

        xqkv = self.qkv_proj(hidden_states)
        xqkv = xqkv.view((bsz, seqlen) + self.attention_shapes["xqkv_view"])

        xq = self.attention_shapes["xq_slice"](xqkv)
        xk = self.attention_shapes["xk_slice"](xqkv)
        xv = self.attention_shapes["xv_slice"](xqkv)

        if seqlen > 1 or not FT_INSTALLED:
            xq = xq.view((bsz, seqlen) + self.attention_shapes["xq_view"])
            xk = xk.view((bsz, seqlen) + self.attention_shapes["xk_view"])
            xv = xv.view((bsz, seqlen) + self.attention_shapes["xv_view"])

            if not self.use_alibi:
                xq, xk = self.rope.forward(xq, xk, self.start_pos, seqlen)

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

            if self.n_kv_groups != 0:
                keys = torch.repeat_interleave(keys, dim=2, repeats=self.n_kv_groups)
                values = torch.repeat_interleave(values, dim=2, repeats=self.n_kv_groups)

            xq = xq.transpose(1, 2)
            keys = keys.transpose(1, 2)
            values = values.transpose(1, 2)
            scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)

            # When seqlen is 1, there is nothing else to attend to
            if attention_mask is not None and seqlen > 1:
                scores = scores + attention_mask  # (bs, n_local_heads, slen, cache_len + slen)
            scores = F.softmax(scores.float(), dim=-1).type_as(xq)
            output = torch.matmul(scores, values)  # (bs, n_local_heads, slen, head_dim)
            attention_weight = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)

        attn_output = self.o_proj(attention_weight)
        self.start_pos += seqlen

        past_key_value = [torch.zeros(1, 1, self.start_pos, 1)]
        return attn_output, attention_weight, past_key_value


# ---------------------------------------------------------------- awq/modules/fused/{norm,mlp,block,model}.py


class FasterTransformerRMSNorm(nn.Module):
    def __init__(self, weight, eps=1e-6):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, x):
        # awq_inference_engine.layernorm_forward_cuda, written out
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.variance_epsilon)).type_as(x) * self.weight


class QuantLlamaMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLikeBlock(nn.Module):
    def __init__(self, hidden_size, n_heads, n_kv_heads, qkv_layer, o_proj, mlp, norm_1, norm_2, dev, max_seq_len):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.hidden_size = hidden_size
        self.norm_1 = norm_1.to(dev)
        self.attn = QuantAttentionFused(
            self.hidden_size, self.n_heads, self.n_kv_heads, qkv_layer, o_proj,
            dev=dev, max_seq_len=max_seq_len, use_alibi=False,
        ).to(dev)
        self.norm_2 = norm_2.to(dev)
        self.mlp = mlp.to(dev)

    def forward(self, hidden_states, past_key_value, attn_bias=None, attention_mask=None, is_causal=None):
        norm_out = self.norm_1(hidden_states)
        attn_output, _, past_key_value = self.attn.forward(
            hidden_states=norm_out, past_key_value=past_key_value, attention_mask=attention_mask
        )
        h = hidden_states + attn_output
        out = h + self.mlp.forward(self.norm_2(h))
        return out, None, past_key_value


class LlamaLikeModel(nn.Module):
    def __init__(self, vocab_size, blocks, embedding, norm):
        super().__init__()
        self.vocab_size = vocab_size
        self.embedding = embedding
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm
        self.last_forward_num_tokens = 0

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attn_bias=None, attention_mask=None, is_causal=None, *args, **kwargs):
        input_ids, self.last_forward_num_tokens = prepare_input_ids(input_ids, self.last_forward_num_tokens)
        _bsz, seqlen = input_ids.shape

        if FIXED:
            prepare_cache(self.blocks, seqlen)

        h = self.embedding(input_ids)

        mask = prepare_attention_mask(
            seqlen=seqlen, start_pos=self.blocks[0].attn.start_pos, device=input_ids.device, type_as=h
        )

        for layer in self.blocks:
            h, _, past_key_value = layer(h, None, attention_mask=mask, is_causal=is_causal)
        h = self.norm(h)
        return h


# ---------------------------------------------------------------- a fused tiny Mistral-like model


class FusedCausalLM(nn.Module):
    def __init__(self, vocab_size=80, hidden_size=64, n_heads=4, n_kv_heads=2, intermediate_size=128,
                 n_layers=2, max_seq_len=64):
        super().__init__()
        head_dim = hidden_size // n_heads
        blocks = []
        for _ in range(n_layers):
            qkv_layer = nn.Linear(hidden_size, (n_heads + 2 * n_kv_heads) * head_dim, bias=False)
            o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
            mlp = QuantLlamaMLP(hidden_size, intermediate_size)
            norm_1 = FasterTransformerRMSNorm(nn.Parameter(torch.ones(hidden_size)))
            norm_2 = FasterTransformerRMSNorm(nn.Parameter(torch.ones(hidden_size)))
            blocks.append(
                LlamaLikeBlock(hidden_size, n_heads, n_kv_heads, qkv_layer, o_proj, mlp, norm_1, norm_2,
                               dev="cpu", max_seq_len=max_seq_len)
            )
        self.model = LlamaLikeModel(
            vocab_size, blocks, nn.Embedding(vocab_size, hidden_size),
            FasterTransformerRMSNorm(nn.Parameter(torch.ones(hidden_size))),
        )
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


@torch.inference_mode()
def greedy_generate(model, input_ids, max_new_tokens):
    # transformers >= 4.35 hands the fused model the full context at every step
    for _ in range(max_new_tokens):
        logits = model(input_ids)[:, -1, :]
        next_token = logits.argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, next_token], dim=-1)
    return input_ids


def main():
    torch.manual_seed(0)
    model = FusedCausalLM().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "freqs_cis" in name:
                continue
            if p.dim() == 1:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.3)

    prompt_1 = torch.tensor([[1, 23, 7, 51, 14, 38, 9]])
    out_1 = greedy_generate(model, prompt_1, max_new_tokens=6)
    print("generate 1:", out_1[0, prompt_1.shape[1]:].tolist())
    print("start_pos after generate 1:", [b.attn.start_pos for b in model.model.blocks])

    prompt_2 = torch.tensor([[1, 44, 12, 60, 3, 27, 70, 18, 5]])
    out_2 = greedy_generate(model, prompt_2, max_new_tokens=6)
    print("generate 2:", out_2[0, prompt_2.shape[1]:].tolist())
    print("start_pos after generate 2:", [b.attn.start_pos for b in model.model.blocks])


if __name__ == "__main__":
    main()
