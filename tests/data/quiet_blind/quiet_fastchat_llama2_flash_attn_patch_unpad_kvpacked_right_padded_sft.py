# Correct program (quiet batch quiet-r75a).
# Ported from lm-sys/FastChat @151c6ac31b5646cc2975cb25c181e007fa280b8b,
# fastchat/train/llama2_flash_attn_monkey_patch.py (forward, apply_rotary_pos_emb, _prepare_decoder_attention_mask,
# replace_llama_attn_with_flash_attn), as fastchat/train/train_mem.py uses it for Vicuna SFT: the padded batch of
# fastchat/train/train.py preprocess (right padding with the pad token, attention_mask = input_ids.ne(pad_token_id),
# labels IGNORE_TOKEN_ID on the instruction part and on the padding) goes through a LLaMA-2 (GQA) whose
# LlamaModel._prepare_decoder_attention_mask is replaced to hand the 2-D boolean key padding mask to every layer
# unchanged (None when the batch has no padding), and whose LlamaAttention.forward unpads q with
# key_padding_mask[:, -q_len:] and the stacked (k, v) with key_padding_mask (flash_attn.bert_padding.unpad_input),
# runs flash_attn_varlen_kvpacked_func(causal=True) over cu_q_lens / cu_k_lens and pads the output back
# (pad_input); flash_attn_func(causal=True) when the mask is None. The LlamaModel / LlamaForCausalLM around the patch
# follow transformers 4.31 (position_ids = arange, attention_mask defaulting to ones, shifted cross-entropy).
# No flash-attn on CPU: unpad_input / pad_input / index_first_axis follow flash_attn/bert_padding.py
# (Dao-AILab/flash-attention @3c0d49532cb3bc0a36b405f34590ff82cf582853, 4-tuple return of flash-attn 2.0-2.5), and
# the two kernels are plain-torch stand-ins with their arguments (bottom-right causal alignment, GQA by head groups).
# Self-check: every conversation run alone, unpadded (mask None, the flash_attn_func path), through the same weights;
# each real token's logits and the summed token loss must match the padded batch's, and the batch loss equals the
# per-token mean over all supervised tokens. A batch with no padding (mask -> None) and the padded batch with two rows
# padded on the left (as the patch's own test() does) are checked the same way; the padded step's k_proj gradient
# equals that of the per-conversation losses.
import math
import sys
import warnings
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
IGNORE_TOKEN_ID = -100


# ---- flash_attn.bert_padding (flash-attn 2.x) ----
def index_first_axis(input, indices):
    assert input.ndim >= 2
    first_axis_dim, other_shape = input.shape[0], input.shape[1:]
    return input.reshape(first_axis_dim, -1)[indices].reshape(-1, *other_shape)


def index_put_first_axis(values, indices, first_axis_dim):
    output = torch.zeros((first_axis_dim, *values.shape[1:]), device=values.device, dtype=values.dtype)
    output[indices] = values
    return output


def unpad_input(hidden_states, attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    b, s = hidden_states.shape[:2]
    return (
        index_first_axis(hidden_states.reshape(b * s, *hidden_states.shape[2:]), indices),
        indices,
        cu_seqlens,
        max_seqlen_in_batch,
    )


def pad_input(hidden_states, indices, batch, seqlen):
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.reshape(batch, seqlen, *hidden_states.shape[1:])


# ---- plain-torch stand-ins for the flash-attn 2 kernels (same arguments) ----
def _attend(q, k, v, softmax_scale, causal):
    # q: (lq, h, d), k / v: (lk, hk, d); GQA by head groups; causal aligned bottom-right (flash-attn >= 2.1)
    lq, h, d = q.shape
    lk, hk = k.shape[:2]
    if hk != h:
        k = k.repeat_interleave(h // hk, dim=1)
        v = v.repeat_interleave(h // hk, dim=1)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        allowed = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    return torch.stack([_attend(q[b], k[b], v[b], softmax_scale, causal) for b in range(q.shape[0])])


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False):
    out = torch.zeros_like(q)
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        assert qe - qs <= max_seqlen_q and ke - ks <= max_seqlen_k
        out[qs:qe] = _attend(q[qs:qe], kv[ks:ke, 0], kv[ks:ke, 1], softmax_scale, causal)
    return out


# ---- transformers 4.31 LLaMA (trimmed) ----
class LlamaConfig:
    def __init__(self, **kw):
        self.vocab_size = 97
        self.hidden_size = 64
        self.intermediate_size = 112
        self.num_hidden_layers = 2
        self.num_attention_heads = 4
        self.num_key_value_heads = 2
        self.max_position_embeddings = 64
        self.rms_norm_eps = 1e-6
        self.pad_token_id = 0
        self.__dict__.update(kw)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_position_embeddings, dtype=inv_freq.dtype)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None, :, :], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None, :, :], persistent=False)

    def forward(self, x, seq_len=None):
        return (self.cos_cached[:, :, :seq_len, ...].to(dtype=x.dtype),
                self.sin_cached[:, :, :seq_len, ...].to(dtype=x.dtype))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, config.max_position_embeddings)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, use_cache=False):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _, present = self.self_attn(
            hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids,
            past_key_value=past_key_value, use_cache=use_cache)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def _prepare_decoder_attention_mask(self, attention_mask, input_shape, inputs_embeds, past_key_values_length):
        raise NotImplementedError("replaced by replace_llama_attn_with_flash_attn()")

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        batch_size, seq_length = input_ids.shape
        past_key_values_length = 0
        if position_ids is None:
            position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length,
                                        dtype=torch.long, device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).view(-1, seq_length)
        inputs_embeds = self.embed_tokens(input_ids)
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, seq_length), dtype=torch.bool, device=inputs_embeds.device)
        attention_mask = self._prepare_decoder_attention_mask(
            attention_mask, (batch_size, seq_length), inputs_embeds, past_key_values_length)
        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states, _ = decoder_layer(hidden_states, attention_mask=attention_mask, position_ids=position_ids)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, labels=None):
        hidden_states = self.model(input_ids=input_ids, attention_mask=attention_mask)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            loss = nn.CrossEntropyLoss()(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
        return loss, logits


# ---- fastchat/train/llama2_flash_attn_monkey_patch.py ----
def apply_rotary_pos_emb(q, k, cos_sin, position_ids):
    gather_indices = position_ids[:, :, None, None]  # [bsz, seq_len, 1, 1]
    gather_indices = gather_indices.repeat(1, 1, cos_sin[0].shape[1], cos_sin[0].shape[3])
    bsz = gather_indices.shape[0]
    cos, sin = (torch.gather(x.transpose(1, 2).repeat(bsz, 1, 1, 1), 1, gather_indices) for x in cos_sin)
    q, k = ((x * cos) + (rotate_half(x) * sin) for x in (q, k))
    return q, k


def forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    past_key_value: Optional[Tuple[torch.Tensor]] = None,
    output_attentions: bool = False,
    use_cache: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[Tuple[torch.Tensor]]]:
    if output_attentions:
        warnings.warn("Output attentions is not supported for patched `LlamaAttention`, returning `None` instead.")

    bsz, q_len, _ = hidden_states.size()
    kv_heads = getattr(self, "num_key_value_heads", self.num_heads)

    q, k, v = (op(hidden_states).view(bsz, q_len, nh, self.head_dim) for op, nh in (
        (self.q_proj, self.num_heads),
        (self.k_proj, kv_heads),
        (self.v_proj, kv_heads),
    ))
    # shape: (b, s, num_heads, head_dim)

    kv_seq_len = k.shape[1]
    if past_key_value is not None:
        kv_seq_len += past_key_value[0].shape[1]

    cos_sin = self.rotary_emb(v, seq_len=kv_seq_len)
    q, k = apply_rotary_pos_emb(q, k, cos_sin, position_ids)

    if past_key_value is not None:
        # reuse k, v
        k = torch.cat([past_key_value[0], k], dim=1)
        v = torch.cat([past_key_value[1], v], dim=1)

    past_key_value = (k, v) if use_cache else None

    key_padding_mask = attention_mask
    if key_padding_mask is None:
        output = flash_attn_func(q, k, v, 0.0, softmax_scale=None, causal=True).view(bsz, q_len, -1)
    else:
        q, indices, cu_q_lens, max_s = unpad_input(q, key_padding_mask[:, -q_len:])
        # We can skip concat and call unpad twice but seems better to call unpad only once.
        kv, _, cu_k_lens, max_k = unpad_input(torch.stack((k, v), dim=2), key_padding_mask)
        output_unpad = flash_attn_varlen_kvpacked_func(
            q, kv,
            cu_q_lens, cu_k_lens, max_s, max_k,
            0.0, softmax_scale=None, causal=True)
        output_unpad = output_unpad.reshape(-1, self.num_heads * self.head_dim)
        output = pad_input(output_unpad, indices, bsz, q_len)

    return self.o_proj(output), None, past_key_value


# Disable the transformation of the attention mask in LlamaModel as flash attention
# takes a boolean key_padding_mask. Fills in the past kv length for use in forward.
def _prepare_decoder_attention_mask(self, attention_mask, input_shape, inputs_embeds, past_key_values_length):
    # [bsz, seq_len]
    if past_key_values_length > 0 and attention_mask is not None:
        attention_mask = torch.cat((
            torch.full((input_shape[0], past_key_values_length), True,
                       dtype=attention_mask.dtype, device=attention_mask.device),
            attention_mask,
        ), dim=-1)

    if attention_mask is not None and torch.all(attention_mask):
        return None

    return attention_mask


def replace_llama_attn_with_flash_attn():
    LlamaModel._prepare_decoder_attention_mask = _prepare_decoder_attention_mask
    LlamaAttention.forward = forward


# ---- fastchat/train/train.py preprocess (trimmed: token ids instead of a tokenizer) ----
def preprocess(conversations, model_max_length, pad_token_id, sides=None):
    """conversations: list of (instruction_ids, answer_ids); train.py pads on the right."""
    input_ids, targets = [], []
    for i, (instr, answer) in enumerate(conversations):
        ids = torch.tensor(instr + answer, dtype=torch.long)
        target = ids.clone()
        target[: len(instr)] = IGNORE_TOKEN_ID
        pad = model_max_length - ids.numel()
        where = (0, pad) if sides is None or sides[i] == "right" else (pad, 0)
        input_ids.append(F.pad(ids, where, value=pad_token_id))
        targets.append(F.pad(target, where, value=IGNORE_TOKEN_ID))
    input_ids = torch.stack(input_ids)
    return dict(input_ids=input_ids, labels=torch.stack(targets), attention_mask=input_ids.ne(pad_token_id))


def rand_ids(n, g):
    return torch.randint(3, 97, (n,), generator=g).tolist()


def check_batch(model, conversations, model_max_length, pad_token_id, sides=None):
    batch = preprocess(conversations, model_max_length, pad_token_id, sides)
    loss, logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])

    total, count = 0.0, 0
    for b, (instr, answer) in enumerate(conversations):
        n = len(instr) + len(answer)
        ids = torch.tensor([instr + answer])
        labels = ids.clone()
        labels[0, : len(instr)] = IGNORE_TOKEN_ID
        _, ref_logits = model(input_ids=ids)
        real = batch["attention_mask"][b]
        assert int(real.sum()) == n
        torch.testing.assert_close(logits[b][real], ref_logits[0], atol=2e-5, rtol=1e-4)
        tok = F.cross_entropy(ref_logits[0, :-1], labels[0, 1:], ignore_index=IGNORE_TOKEN_ID, reduction="sum")
        total += tok
        count += int((labels[0, 1:] != IGNORE_TOKEN_ID).sum())
    torch.testing.assert_close(loss, total / count, atol=1e-5, rtol=1e-5)
    return float(loss)


def main():
    replace_llama_attn_with_flash_attn()
    config = LlamaConfig()
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)

    # right-padded SFT batch: three conversations of different lengths, padded to model_max_length
    conversations = [(rand_ids(4, g), rand_ids(7, g)), (rand_ids(6, g), rand_ids(3, g)), (rand_ids(3, g), rand_ids(2, g))]
    with torch.no_grad():
        l1 = check_batch(model, conversations, model_max_length=14, pad_token_id=config.pad_token_id)
        # a batch whose rows fill model_max_length exactly: the patched mask preparation hands None to the layers
        full = [(rand_ids(5, g), rand_ids(5, g)), (rand_ids(2, g), rand_ids(8, g))]
        l2 = check_batch(model, full, model_max_length=10, pad_token_id=config.pad_token_id)
        # the patch's own test() also feeds rows padded on the left (mask[1, :i] = False) with position_ids = arange;
        # the unpadded q / kv spans and RoPE's relative angles make each row equal its run alone
        l3 = check_batch(model, conversations, model_max_length=14, pad_token_id=config.pad_token_id,
                         sides=["right", "left", "left"])

    # one training step on the padded batch: gradients equal those of the per-conversation sum
    batch = preprocess(conversations, 14, config.pad_token_id)
    model.zero_grad()
    loss, _ = model(**batch)
    loss.backward()
    g_batch = model.model.layers[0].self_attn.k_proj.weight.grad.clone()
    model.zero_grad()
    count = sum(len(a) for _, a in conversations)
    for instr, answer in conversations:
        ids = torch.tensor([instr + answer])
        labels = ids.clone()
        labels[0, : len(instr)] = IGNORE_TOKEN_ID
        _, lg = model(input_ids=ids)
        (F.cross_entropy(lg[0, :-1], labels[0, 1:], ignore_index=IGNORE_TOKEN_ID, reduction="sum") / count).backward()
    torch.testing.assert_close(g_batch, model.model.layers[0].self_attn.k_proj.weight.grad, atol=1e-6, rtol=1e-4)
    print(f"ok: right-padded loss {l1:.4f}, unpadded loss {l2:.4f}, left-padded loss {l3:.4f} match per-conversation runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
