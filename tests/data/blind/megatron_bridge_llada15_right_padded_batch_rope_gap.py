# Citation: NVIDIA-NeMo/Megatron-Bridge#4760 "[diffusion] fix: preserve LLaDA batch positions"
#   (commit 60ee9631a71eb37df6b7ea657180940955a553c5; bug introduced with LLaDA1.5 support in #4019, cc3a7d88e).
# Upstream code ported here:
#   examples/models/diffusion/inference_dllm.py            (_encode_prompts, main)
#   src/megatron/bridge/diffusion/models/llada15/inference_llada15.py (generate_block_diffusion,
#       _set_padding_mask, _clear_attention_state)
#   src/megatron/bridge/diffusion/models/llada15/llada15_attention.py (LLaDA15TEDotProductAttention:
#       set_padding_mask + forward that turns the [B, S] key-padding mask into a [B, 1, S, S] "arbitrary" mask)
#   src/megatron/bridge/diffusion/common/dllm.py            (get_num_transfer_tokens, get_transfer_index)
# Bug: mixed-length prompts for the fully bidirectional LLaDA1.5 model were RIGHT-padded. The key-padding
#   mask blocks the trailing pads, but Megatron applies RoPE by physical sequence index (position_ids are
#   not used by RoPE), and the <MASK> canvas always starts after the batch-wide prompt width, so the short
#   row's generated block sits a "gap" of masked-out pad slots away from its own prompt: the relative
#   positions between a short prompt and its generation depend on the longest prompt in the batch.
# Fix: pad LLaDA prompts on the LEFT (padding_side = "left" if model == "llada15"), so the short prompt
#   and its generated suffix are contiguous; the same key-padding mask now blocks the leading pads.
# Tiny random model, CPU, torch only. TransformerEngine's DotProductAttention is replaced by a plain
# torch stand-in with the same mask semantics (bool mask, True = blocked; no_mask = full attention).
import math
import sys
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------------------------------------------------------------------
# megatron.core stand-ins
# ---------------------------------------------------------------------------
class AttnMaskType:
    padding = "padding"
    causal = "causal"
    no_mask = "no_mask"
    arbitrary = "arbitrary"


class TEDotProductAttention(nn.Module):
    """Plain-torch stand-in for megatron.core.extensions.transformer_engine.TEDotProductAttention.

    Layout sbhd: query/key/value [S, B, H, D] -> [S, B, H*D].
    attention_mask: bool, True = masked out (Megatron convention).
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None, **kwargs):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        attn_mask_type = attn_mask_type or self.attn_mask_type
        S, B, H, D = query.shape
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D)
        if attn_mask_type == AttnMaskType.causal:
            causal = torch.ones(S, S, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(causal, float("-inf"))
        elif attn_mask_type in (AttnMaskType.arbitrary, AttnMaskType.padding) and attention_mask is not None:
            scores = scores.masked_fill(attention_mask, float("-inf"))
        # no_mask: full bidirectional attention
        probs = scores.softmax(dim=-1)
        out = probs @ v  # [B, H, S, D]
        return out.permute(2, 0, 1, 3).reshape(S, B, H * D)


# ---------------------------------------------------------------------------
# llada15_attention.py
# ---------------------------------------------------------------------------
class LLaDA15TEDotProductAttention(TEDotProductAttention):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None, **kwargs):
        super().__init__(
            config=config,
            layer_number=layer_number,
            attn_mask_type=AttnMaskType.no_mask,
            attention_type=attention_type,
            attention_dropout=attention_dropout,
            **kwargs,
        )
        self._block_attn_mask: Optional[torch.Tensor] = None
        self._pad_key_mask: Optional[torch.Tensor] = None

    def set_block_mask(self, mask):
        self._block_attn_mask = mask

    def set_padding_mask(self, mask):
        self._pad_key_mask = mask

    def reset_inference_state(self):
        self._block_attn_mask = None
        self._pad_key_mask = None

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        S, B = query.shape[0], query.shape[1]
        combined = None

        if self._block_attn_mask is not None:
            block = self._block_attn_mask[:, :, :S, :S]
            block = torch.isinf(block) if block.is_floating_point() else block.bool()
            combined = block.expand(B, 1, S, S)

        if self._pad_key_mask is not None:
            pad = self._pad_key_mask[:, :S].bool()[:, None, None, :].expand(B, 1, S, S)
            combined = pad if combined is None else (combined | pad)

        if combined is not None:
            return super().forward(
                query, key, value,
                attention_mask=combined.contiguous(),
                attn_mask_type=AttnMaskType.arbitrary,
                attention_bias=None,
                packed_seq_params=packed_seq_params,
            )

        return super().forward(
            query, key, value,
            attention_mask=attention_mask,
            attn_mask_type=AttnMaskType.no_mask,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )


# ---------------------------------------------------------------------------
# Tiny Megatron GPTModel (RoPE by physical sequence index, as in MCore's GPTModel)
# ---------------------------------------------------------------------------
class RotaryEmbedding(nn.Module):
    def __init__(self, kv_channels, rotary_base=500000.0):
        super().__init__()
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, kv_channels, 2).float() / kv_channels))

    def forward(self, max_seq_len):
        seq = torch.arange(max_seq_len, dtype=torch.float32)
        freqs = torch.outer(seq, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]  # [S, 1, 1, D]


def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    return t * freqs.cos() + _rotate_half(t) * freqs.sin()


class SelfAttention(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.config = config
        h, nh = config.hidden_size, config.num_attention_heads
        self.nh, self.hd = nh, h // nh
        self.linear_qkv = nn.Linear(h, 3 * h, bias=False)
        self.linear_proj = nn.Linear(h, h, bias=False)
        self.core_attention = LLaDA15TEDotProductAttention(
            config, layer_number, attn_mask_type=AttnMaskType.causal, attention_type="self"
        )

    def forward(self, hidden_states, attention_mask, rotary_pos_emb):
        S, B, _ = hidden_states.shape
        qkv = self.linear_qkv(hidden_states).view(S, B, self.nh, 3 * self.hd)
        q, k, v = torch.split(qkv, self.hd, dim=-1)
        q = apply_rotary_pos_emb(q, rotary_pos_emb)
        k = apply_rotary_pos_emb(k, rotary_pos_emb)
        out = self.core_attention(q, k, v, attention_mask=attention_mask)
        return self.linear_proj(out)


class TransformerLayer(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = nn.RMSNorm(h)
        self.self_attention = SelfAttention(config, layer_number)
        self.pre_mlp_layernorm = nn.RMSNorm(h)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h, bias=False), nn.SiLU(), nn.Linear(4 * h, h, bias=False))

    def forward(self, x, attention_mask, rotary_pos_emb):
        x = x + self.self_attention(self.input_layernorm(x), attention_mask, rotary_pos_emb)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class TransformerBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([TransformerLayer(config, i + 1) for i in range(config.num_layers)])
        self.final_layernorm = nn.RMSNorm(config.hidden_size)

    def forward(self, x, attention_mask, rotary_pos_emb):
        for layer in self.layers:
            x = layer(x, attention_mask, rotary_pos_emb)
        return self.final_layernorm(x)


class GPTModel(nn.Module):
    """position_embedding_type='rope': position_ids are accepted but RoPE is built from the sequence length."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_pos_emb = RotaryEmbedding(config.hidden_size // config.num_attention_heads,
                                              config.rotary_base)
        self.decoder = TransformerBlock(config)
        self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, position_ids, attention_mask):
        x = self.embedding(input_ids).transpose(0, 1).contiguous()  # [S, B, H]
        rotary_pos_emb = self.rotary_pos_emb(x.shape[0])
        x = self.decoder(x, attention_mask, rotary_pos_emb)
        return self.output_layer(x).transpose(0, 1).contiguous()  # [B, S, V]


# ---------------------------------------------------------------------------
# common/dllm.py
# ---------------------------------------------------------------------------
def add_gumbel_noise(logits, temperature):
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand_like(logits, dtype=torch.float64)
    gumbel_noise = (-torch.log(noise)) ** temperature
    return logits.exp() / gumbel_noise


def get_num_transfer_tokens(mask_index, steps):
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base = mask_num // steps
    remainder = mask_num % steps
    num_transfer_tokens = torch.zeros(mask_num.size(0), steps, device=mask_index.device, dtype=torch.int64) + base
    for i in range(mask_num.size(0)):
        num_transfer_tokens[i, : remainder[i]] += 1
    return num_transfer_tokens


def get_transfer_index(logits, temperature, remasking, mask_index, x, num_transfer_tokens, threshold=None,
                       neg_entropy=False):
    logits_with_noise = add_gumbel_noise(logits, temperature=temperature)
    x0 = torch.argmax(logits_with_noise, dim=-1)
    if remasking == "low_confidence":
        p = F.softmax(logits, dim=-1)
        x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
    elif remasking == "random":
        x0_p = torch.rand((x0.shape[0], x0.shape[1]), device=x0.device)
    else:
        raise NotImplementedError(remasking)
    confidence_scores = x0_p
    x0 = torch.where(mask_index, x0, x)
    confidence = torch.where(mask_index, confidence_scores, -np.inf)
    transfer_index = torch.zeros_like(x0, dtype=torch.bool, device=x0.device)
    if threshold is not None:
        num_transfer_tokens = mask_index.sum(dim=1, keepdim=True)
    for j in range(confidence.shape[0]):
        _, select_index = torch.topk(confidence[j], k=int(num_transfer_tokens[j]))
        transfer_index[j, select_index] = True
    return x0, transfer_index


# ---------------------------------------------------------------------------
# inference_llada15.py
# ---------------------------------------------------------------------------
def _unwrap(model):
    if hasattr(model, "module"):
        return _unwrap(model.module)
    return model


def _iter_llada15_attentions(model):
    for layer in _unwrap(model).decoder.layers:
        ca = layer.self_attention.core_attention
        if isinstance(ca, LLaDA15TEDotProductAttention):
            yield ca


def _set_padding_mask(model, mask):
    for attn in _iter_llada15_attentions(model):
        attn.set_padding_mask(mask)


def _clear_attention_state(model):
    for attn in _iter_llada15_attentions(model):
        attn.reset_inference_state()


@torch.no_grad()
def generate_block_diffusion(model, input_ids, *, gen_length=256, block_length=32, steps=32, temperature=0.0,
                             remasking="low_confidence", neg_entropy=False, threshold=None,
                             mask_token_id=126336, eos_token_id=126081, eos_early_stop=False,
                             pad_token_id=None, trace=None):
    device = input_ids.device
    B, prompt_len = input_ids.shape
    total_length = prompt_len + gen_length

    x = torch.full((B, total_length), mask_token_id, dtype=torch.long, device=device)
    x[:, :prompt_len] = input_ids

    num_blocks = (gen_length + block_length - 1) // block_length
    steps_per_block = max(1, steps // max(num_blocks, 1))

    position_ids = torch.arange(total_length, device=device).unsqueeze(0).expand(B, -1)

    pad_key_mask = None
    if pad_token_id is not None:
        prompt_pad = input_ids == pad_token_id
        if bool(prompt_pad.any()):
            pad_key_mask = torch.zeros(B, total_length, dtype=torch.bool, device=device)
            pad_key_mask[:, :prompt_len] = prompt_pad
    _set_padding_mask(model, pad_key_mask)

    try:
        for block_idx in range(num_blocks):
            block_start = prompt_len + block_idx * block_length
            block_end = min(block_start + block_length, total_length)
            block_slice = slice(block_start, block_end)

            block_mask0 = x[:, block_slice] == mask_token_id
            num_transfer = get_num_transfer_tokens(block_mask0, steps_per_block)

            for step_idx in range(steps_per_block):
                mask_now = x[:, block_slice] == mask_token_id
                if mask_now.sum() == 0:
                    break

                output = model(input_ids=x, position_ids=position_ids, attention_mask=None)
                logits = output if isinstance(output, torch.Tensor) else output[0]
                block_logits = logits[:, block_slice, :]
                if trace is not None and block_idx == 0 and step_idx == 0:
                    trace.append(block_logits.float().clone())

                x0, transfer_index = get_transfer_index(
                    block_logits, temperature, remasking, mask_now, x[:, block_slice],
                    num_transfer_tokens=num_transfer[:, step_idx], threshold=threshold, neg_entropy=neg_entropy,
                )
                cur = x[:, block_slice].clone()
                cur[transfer_index] = x0[transfer_index]
                x[:, block_slice] = cur

                if eos_early_stop and eos_token_id is not None:
                    if (x[:, prompt_len:] == eos_token_id).any():
                        return x
        return x
    finally:
        _clear_attention_state(model)


# ---------------------------------------------------------------------------
# examples/models/diffusion/inference_dllm.py
# ---------------------------------------------------------------------------
class _WordTokenizer:
    """Offline stand-in for AutoTokenizer: one id per word, HF-style padding."""

    chat_template = None

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size
        self.eos_token_id = vocab_size - 2
        self.eos_token = "<eos>"
        self.pad_token = None
        self.pad_token_id = None

    def encode(self, text):
        return [1 + (sum(ord(c) * (i + 1) for i, c in enumerate(w)) % (self.vocab_size - 4)) for w in text.split()]

    def __call__(self, texts, return_tensors="pt", padding=True, padding_side="right"):
        rows = [self.encode(t) for t in texts]
        width = max(len(r) for r in rows)
        out = []
        for r in rows:
            pads = [self.pad_token_id] * (width - len(r))
            out.append(pads + r if padding_side == "left" else r + pads)
        return SimpleNamespace(input_ids=torch.tensor(out, dtype=torch.long))

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(str(int(t)) for t in row) for row in ids]


if FIXED:
    def _encode_prompts(tokenizer, prompts, use_chat_template, model):
        texts = prompts
        padding_side = "left" if model == "llada15" else "right"
        return tokenizer(texts, return_tensors="pt", padding=True, padding_side=padding_side)
else:
    def _encode_prompts(tokenizer, prompts, use_chat_template):
        texts = prompts
        return tokenizer(texts, return_tensors="pt", padding=True, padding_side="right")


def main():
    args = SimpleNamespace(
        model="llada15",
        prompts=["the capital of france is",
                 "write a very short story about a small robot who learns to paint the sea at night"],
        gen_length=8, block_length=4, steps=8, temperature=0.0,
        mask_token_id=None, eos_token_id=None, no_eos_early_stop=False, no_chat_template=True,
    )
    if len(args.prompts) > 1 and not args.no_eos_early_stop:
        print("[info] multiple prompts: disabling EOS early-stop (it is batch-global).")
        args.no_eos_early_stop = True

    config = SimpleNamespace(vocab_size=64, hidden_size=32, num_attention_heads=4, num_layers=2,
                             rotary_base=10000.0)
    args.mask_token_id = config.vocab_size - 1

    tokenizer = _WordTokenizer(config.vocab_size)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
        tokenizer.pad_token_id = tokenizer.eos_token_id
    if args.eos_token_id is None:
        args.eos_token_id = tokenizer.eos_token_id
    args.pad_token_id = tokenizer.pad_token_id

    torch.manual_seed(0)
    model = GPTModel(config).eval()

    if FIXED:
        inputs = _encode_prompts(tokenizer, args.prompts, use_chat_template=not args.no_chat_template,
                                 model=args.model)
    else:
        inputs = _encode_prompts(tokenizer, args.prompts, use_chat_template=not args.no_chat_template)
    prompt_ids = inputs.input_ids
    prompt_len = prompt_ids.shape[1]
    print("prompt_ids:\n", prompt_ids)

    trace = []
    with torch.no_grad():
        output = generate_block_diffusion(
            model=model, input_ids=prompt_ids, gen_length=args.gen_length, block_length=args.block_length,
            steps=args.steps, temperature=args.temperature, mask_token_id=args.mask_token_id,
            eos_token_id=args.eos_token_id, eos_early_stop=not args.no_eos_early_stop,
            pad_token_id=args.pad_token_id, trace=trace,
        )

    generated = output[:, prompt_len:]
    texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
    first_logits = trace[0]
    for i, (prompt, text) in enumerate(zip(args.prompts, texts)):
        print(f"\n--- Prompt {i + 1}/{len(args.prompts)} ({args.model}) ---")
        print(f"USER: {prompt}")
        print(f"OUTPUT ids: {text}")
        print(f"first-step block logits: mean={first_logits[i].mean().item():+.5f} "
              f"row0[:4]={[round(v, 4) for v in first_logits[i, 0, :4].tolist()]}")


if __name__ == "__main__":
    main()
