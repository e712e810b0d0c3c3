"""DeepSpeed Hybrid Engine (DS-Chat) BLOOM generation: the already-inverted HF mask is inverted again.

Citation: deepspeedai/DeepSpeed#5101 (commit d9e12d3a6, "Fix attention mask
handling in the Hybrid Engine Bloom flow"), read in the upstream git history
(deepspeed/ops/transformer/inference/ds_attention.py,
deepspeed/module_inject/containers/bloom.py).

Bug: `transformers.BloomModel.forward` turns the 2D padding mask into a 4D
causal mask and casts it with `.bool()`, so `True` means "masked". The
injected `BloomSelfAttention.compute_attention` (after #4338 cast the bool to
long) still passed `attn_mask=(1 - input_mask) * minus_inf` to the softmax
kernel, i.e. it inverted the mask a second time, and the container kept
`triangular_masking=True`, so the kernel also re-applied its own causal
triangle. With left-padded prompts, the padded rows' attention went to the
padding keys (the only keys without the -10000 bias) during prefill and every
decode step.

Fix: `DS_BloomContainer` sets `triangular_masking = False` and
`config.invert_mask = False`; `compute_attention` only inverts when
`config.invert_mask` and passes `attn_mask=input_mask * minus_inf`.

This program: the DS Bloom attention (`compute_attention` with `layer_past`),
a torch port of the inference softmax op (scale, triangular, alibi, additive
mask), and the HF-side mask and alibi construction (`BloomModel.forward`, as in
transformers 4.36) in plain torch; a left-padded batch of two prompts runs a
prefill and two decode steps, as the Hybrid Engine's generate does.
"""
import math
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

minus_inf = -10000.0


class DeepSpeedInferenceConfig:
    def __init__(self, hidden_size, heads, mp_size=1, dtype=torch.float32, triangular_masking=True,
                 invert_mask=True):
        self.hidden_size = hidden_size
        self.heads = heads
        self.mp_size = mp_size
        self.dtype = dtype
        self.triangular_masking = triangular_masking
        self.invert_mask = invert_mask
        self.bigscience_bloom = True


class SoftmaxOp:
    """Torch port of the inference softmax kernel (softmax_fp32)."""

    def __init__(self, config):
        self.config = config
        self.num_attention_heads_per_partition = config.heads // config.mp_size

    def __call__(self, attn_scores, attn_mask, alibi, triangular, recompute, local_attention, window_size,
                 async_op, layer_scale, head_offset):
        attn_scores = attn_scores * layer_scale
        if triangular:
            q, k = attn_scores.shape[-2:]
            tri = ~torch.ones(q, k, dtype=torch.bool).tril(k - q)
            attn_scores = attn_scores.masked_fill(tri, torch.finfo(attn_scores.dtype).min)
        if alibi is not None:
            b, h = attn_scores.shape[:2]
            attn_scores = attn_scores + alibi.view(b, h, 1, -1)
        if attn_mask is not None:
            attn_scores = attn_scores + attn_mask
        return F.softmax(attn_scores, dim=-1, dtype=torch.float32)


class BloomSelfAttention(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size_per_partition = config.hidden_size // config.mp_size
        self.num_attention_heads_per_partition = config.heads // config.mp_size
        self.norm_factor = math.sqrt(math.sqrt(config.hidden_size // config.heads))
        self.query_key_value = torch.nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.softmax_func = SoftmaxOp(config)

    def _transpose_for_context(self, x):
        x = x.permute(0, 2, 1, 3).contiguous()
        return x.view(*x.size()[:-2], self.hidden_size_per_partition).contiguous()

    def compute_attention(self, qkv_out, input_mask, layer_past, alibi):
        mixed_x_layer = qkv_out
        head_dim = self.hidden_size_per_partition // self.num_attention_heads_per_partition
        mixed_x_layer = mixed_x_layer.view(*mixed_x_layer.size()[:-1], self.num_attention_heads_per_partition,
                                           3 * head_dim)
        query_layer, key_layer, value_layer = torch.split(mixed_x_layer, head_dim, dim=-1)
        output_size = (query_layer.size(0), query_layer.size(2), query_layer.size(1), key_layer.size(1))
        query_layer = query_layer.transpose(1, 2).reshape(output_size[0] * output_size[1], output_size[2], -1)
        key_layer = key_layer.transpose(1, 2).reshape(output_size[0] * output_size[1], output_size[3],
                                                      -1).transpose(-1, -2)
        value_layer = value_layer.transpose(1, 2).reshape(output_size[0] * output_size[1], output_size[3], -1)
        if layer_past is not None:
            past_key, past_value = layer_past
            key_layer = torch.cat((past_key.type_as(key_layer), key_layer), dim=-1)
            value_layer = torch.cat((past_value.type_as(value_layer), value_layer), dim=-2)
        presents = (key_layer, value_layer)
        matmul_result = torch.matmul(query_layer, key_layer)
        attention_scores = matmul_result.view(output_size[0], output_size[1], output_size[2], -1)
        target_dtype = self.config.dtype

        # When using the hybrid engine with BLOOM, input_mask needs to be converted from torch.bool -> torch.int64
        if input_mask.dtype == torch.bool:
            input_mask = input_mask.long()

        if FIXED:
            # Invert input_mask per transformer implementation (eg, in BLOOM, it's already inverted)
            if self.config.invert_mask:
                input_mask = 1 - input_mask
            attn_mask = input_mask.to(target_dtype) * minus_inf
        else:
            attn_mask = (1 - input_mask).to(target_dtype) * minus_inf

        attention_probs = self.softmax_func(attn_scores=attention_scores,
                                            attn_mask=attn_mask,
                                            alibi=alibi,
                                            triangular=(self.config.triangular_masking
                                                        and (attention_scores.shape[-2] > 1)),
                                            recompute=False,
                                            local_attention=False,
                                            window_size=1,
                                            async_op=False,
                                            layer_scale=1 / (self.norm_factor * self.norm_factor),
                                            head_offset=0)
        attention_probs_reshaped = attention_probs.view(*matmul_result.shape)
        context_layer = torch.bmm(attention_probs_reshaped, value_layer)
        context_layer = context_layer.view(context_layer.size(0) // self.num_attention_heads_per_partition,
                                           self.num_attention_heads_per_partition, context_layer.size(1),
                                           context_layer.shape[-1])
        return self._transpose_for_context(context_layer), presents

    def forward(self, hidden_states, input_mask, layer_past, alibi):
        return self.compute_attention(self.query_key_value(hidden_states), input_mask, layer_past, alibi)


class DS_BloomContainer:
    def __init__(self, hidden_size, heads):
        self.ds_model_config = DeepSpeedInferenceConfig(hidden_size, heads)
        if FIXED:
            self.ds_model_config.triangular_masking = False

    def create_module(self):
        self.module = BloomSelfAttention(self.ds_model_config)
        if FIXED:
            self.module.config.invert_mask = False
        return self.module


# ---- transformers BloomModel.forward side (4.36) ----
def build_alibi_tensor(attention_mask, num_heads, dtype):
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), dtype=torch.float32)
    powers = torch.arange(1, 1 + closest_power_of_2, dtype=torch.int32)
    slopes = torch.pow(base, powers)
    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * arange_tensor
    return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, dtype, past_key_values_length):
    bsz, tgt_len = input_shape
    src_len = tgt_len + past_key_values_length
    causal = torch.ones(tgt_len, src_len, dtype=torch.bool).tril(past_key_values_length)
    keep = causal[None, None] & attention_mask[:, None, None, :].bool()
    return torch.zeros(bsz, 1, tgt_len, src_len, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def bloom_forward(attn, embed, input_ids, attention_mask, layer_past):
    hidden = embed(input_ids)
    past_len = 0 if layer_past is None else layer_past[0].shape[-1]
    alibi = build_alibi_tensor(attention_mask, attn.num_attention_heads_per_partition, hidden.dtype)
    causal_mask = _prepare_4d_causal_attention_mask(attention_mask, input_ids.shape, hidden.dtype, past_len)
    causal_mask = causal_mask.bool()
    return attn(hidden, causal_mask, layer_past, alibi)


def main():
    torch.manual_seed(0)
    hidden, heads, vocab, pad = 32, 4, 50, 3
    attn = DS_BloomContainer(hidden, heads).create_module().eval()
    embed = torch.nn.Embedding(vocab, hidden)
    lm_head = torch.nn.Linear(hidden, vocab, bias=False)
    # DS-Chat actor generation: prompts are left padded.
    prompts = [[11, 12, 13, 14, 15, 16], [21, 22, 23]]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    generated = []
    with torch.no_grad():
        out, past = bloom_forward(attn, embed, input_ids, attention_mask, None)
        for _ in range(2):
            next_tok = lm_head(out[:, -1]).argmax(-1, keepdim=True)
            generated.append(next_tok)
            attention_mask = torch.cat([attention_mask, torch.ones_like(next_tok)], dim=1)
            out, past = bloom_forward(attn, embed, next_tok, attention_mask, past)
    print("fixed" if FIXED else "buggy", "tokens:", torch.cat(generated, 1).tolist(),
          "checksum:", round(out.sum().item(), 4))


if __name__ == "__main__":
    main()
