# Correct program (quiet batch quiet-r148b).
#
# Citation: princeton-nlp/ProLong
#   training/dataset.py @072efb2468ef57417a37fa0552162108d90c6e99 (DataCollator.__call__)
#   training/modeling_flash_llama.py @31ba3df4ee881c9539b0951a724e2c9fbda45889
#     (LlamaRotaryEmbedding, repeat_kv, LlamaAttention.forward, LlamaDecoderLayer, LlamaModel,
#      LlamaForCausalLM.forward with `seq_lengths` -> `unpadded_lengths`, compute_loss)
#
# ProLong trains on packed documents without padding: its DataCollator concatenates every
# document (the `indices` spans of each streamed item) of the micro-batch into one flat 1-D
# `input_ids`, marks the first token of each document -100 in the labels and returns
# `seq_lengths` with attention_mask=None. LlamaForCausalLM turns the lengths into
# `cu_seqlens = F.pad(cumsum(seq_lengths), (1, 0))` and every attention layer calls
# flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
# causal=True), so a token sees only earlier tokens of its own document. Rotary is applied
# over the flat stream (a temporary batch axis, positions 0..total-1): the project notes that
# RoPE is relative, so inside a document the scores equal those of positions restarting at 0.
#
# flash_attn has no CPU build; flash_attn_varlen_kvpacked_func / flash_attn_kvpacked_func and
# flash's apply_rotary_emb_func are written below in plain torch with their signatures (the
# varlen call builds the block-diagonal causal mask its cu_seqlens describe and runs SDPA).
#
# The program runs one training step (collate, forward, loss, backward, AdamW) on two streamed
# items holding five documents, and checks the logits, the loss and the gradients against each
# document run alone (batch of one, plain causal attention, positions from 0).

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN


# ---------------------------------------------------------------- flash_attn stand-ins (CPU)

def rotate_half(x, interleaved=False):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb_func(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                          cu_seqlens=None, max_seqlen=None):
    """flash_attn.layers.rotary.apply_rotary_emb_func: x (batch, seqlen, nheads, headdim),
    cos / sin (seqlen_ro, rotary_dim / 2), position i of x rotated by row i of cos / sin."""
    assert not interleaved and cu_seqlens is None
    seqlen = x.shape[1]
    cos = torch.cat([cos[:seqlen], cos[:seqlen]], dim=-1)[None, :, None, :]
    sin = torch.cat([sin[:seqlen], sin[:seqlen]], dim=-1)[None, :, None, :]
    out = x * cos + rotate_half(x) * sin
    if inplace:
        x.copy_(out)
        return x
    return out


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             return_attn_probs=False):
    """q (batch, seqlen, nheads, d), kv (batch, seqlen, 2, nheads, d)."""
    k, v = kv.unbind(dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        dropout_p=dropout_p, is_causal=causal, scale=softmax_scale,
    )
    return out.transpose(1, 2)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False,
                                    return_attn_probs=False):
    """q (total_q, nheads, d), kv (total_k, 2, nheads, d); sequence i is rows
    cu_seqlens[i]:cu_seqlens[i + 1] and attends only to itself."""
    total_q, total_k = q.shape[0], kv.shape[0]
    seq_q = torch.searchsorted(cu_seqlens_q, torch.arange(total_q, device=q.device), right=True) - 1
    seq_k = torch.searchsorted(cu_seqlens_k, torch.arange(total_k, device=q.device), right=True) - 1
    attn_mask = seq_q[:, None] == seq_k[None, :]
    if causal:
        pos_q = torch.arange(total_q, device=q.device) - cu_seqlens_q[seq_q]
        pos_k = torch.arange(total_k, device=q.device) - cu_seqlens_k[seq_k]
        len_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1])[seq_q]
        len_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1])[seq_k]
        # flash's causal mask is aligned to the bottom-right corner of each sequence
        attn_mask = attn_mask & (pos_k[None, :] <= pos_q[:, None] + (len_k[None, :] - len_q[:, None]))
    k, v = kv.unbind(dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=attn_mask, dropout_p=dropout_p, scale=softmax_scale,
    )
    return out[0].transpose(0, 1)


# ---------------------------------------------------------------- training/dataset.py

@dataclass
class DataArguments:
    single_seq: bool = field(default=False, metadata={"help": "Override the length of the input"})
    subsplit_length: Optional[int] = field(default=None, metadata={"help": "Split sequences into small lengths"})
    per_device_max_tokens: Optional[int] = field(default=4_294_967_296, metadata={"help": "Maximum number of tokens per device"})


class DataCollator:
    def __init__(self, tokenizer, args: DataArguments):
        self.tokenizer = tokenizer
        self.args = args

    def subsplit_indices(self, indices: List[Tuple[int, int]], subsplit_length: int):
        result = []
        for start, end in indices:
            while end - start > subsplit_length:
                result.append((start, start + subsplit_length))
                start += subsplit_length
            result.append((start, end))
        return result

    @torch.no_grad()
    def __call__(self, features):
        input_ids = []
        labels = []
        seq_lengths = []

        available_tokens = self.args.per_device_max_tokens
        for item in features:
            indices = item["indices"] if "indices" in item else [(0, len(item["input_ids"]))]
            if self.args.subsplit_length is not None:
                indices = self.subsplit_indices(indices, self.args.subsplit_length)
            if self.args.single_seq:
                indices = [(0, len(item["input_ids"]))]

            label_seq = torch.tensor(item["input_ids"], dtype=torch.long)

            for a, b in indices:
                b = a + min(b - a, available_tokens)
                if b - a > 1:
                    input_seq = torch.tensor(item["input_ids"][a:b], dtype=torch.long)
                    if self.tokenizer.bos_token_id is not None:
                        if self.args.subsplit_length is not None:
                            input_seq[0] = self.tokenizer.bos_token_id  # Enforce BOS token
                    input_ids.append(input_seq)

                    label_seq[a] = -100  # Don't predict the first token
                    labels.append(label_seq[a:b])

                    seq_lengths.append(b - a)
                    available_tokens -= b - a
                elif available_tokens <= 0:
                    assert available_tokens == 0, "Available tokens should be non-negative"
                    break

        input_ids = torch.concat(input_ids, dim=0)
        labels = torch.concat(labels, dim=0)

        seq_lengths = torch.tensor(seq_lengths, dtype=torch.long)

        return dict(input_ids=input_ids,
                    attention_mask=None,
                    labels=labels,
                    seq_lengths=seq_lengths)


# ---------------------------------------------------------------- training/modeling_flash_llama.py

def rmsnorm_func(hidden_states, weight, variance_epsilon):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + variance_epsilon)
    return (weight * hidden_states).to(input_dtype)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.register_buffer("variance_epsilon", torch.tensor(eps), persistent=False)

    def forward(self, hidden_states):
        return rmsnorm_func(hidden_states, self.weight, self.variance_epsilon)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, config: LlamaConfig, interleaved=False, scaling_factor=1.0):
        super().__init__()
        self.scaling_factor = scaling_factor
        self.interleaved = interleaved
        self.pos_idx_in_fp32 = True
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None

        # ROPE_INIT_FUNCTIONS["default"]
        dim = config.hidden_size // config.num_attention_heads
        base = config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.attention_scaling = 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def _update_cos_sin_cache(self, seq_len, device=None, dtype=None):
        if (seq_len > self._seq_len_cached or self._cos_cached.device != device
                or self._cos_cached.dtype != dtype
                or (self.training and self._cos_cached.is_inference())):
            self._seq_len_cached = seq_len
            t = torch.arange(seq_len, device=device, dtype=torch.float32)
            t /= self.scaling_factor
            freqs = torch.outer(t, self.inv_freq.to(torch.float32))
            self._cos_cached = (torch.cos(freqs) * self.attention_scaling).to(dtype)
            self._sin_cached = (torch.sin(freqs) * self.attention_scaling).to(dtype)

    def forward(self, q, k, seqlen_offset: int = 0, unpadded_lengths=None):
        if unpadded_lengths is not None:
            cu_seqlens, max_seqlen = unpadded_lengths
            if seqlen_offset > 0:
                raise ValueError("seqlen_offset is not supported with unpadded_lengths")
        else:
            cu_seqlens, max_seqlen = None, q.shape[1]

        self._update_cos_sin_cache(max_seqlen + seqlen_offset, q.device, q.dtype)

        return apply_rotary_emb_func(
            q, self._cos_cached[seqlen_offset:], self._sin_cached[seqlen_offset:],
            self.interleaved, True,  # inplace=True,
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen
        ), apply_rotary_emb_func(
            k, self._cos_cached[seqlen_offset:], self._sin_cached[seqlen_offset:],
            self.interleaved, True,  # inplace=True
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen
        )


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return hidden_states
    final_shape = list(hidden_states.shape[:-2]) + [-1] + [hidden_states.shape[-1]]
    expand_shape = [-1] * (len(hidden_states.shape) - 1) + [n_rep] + [-1]
    hidden_states = hidden_states.unsqueeze(-2).expand(expand_shape)
    return hidden_states.reshape(final_shape)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = getattr(config, "num_key_value_heads", self.num_heads)
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads

        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)

        self.register_buffer(
            "norm_factor",
            torch.sqrt(torch.tensor(self.head_dim, dtype=torch.float32)).to(torch.get_default_dtype()),
            persistent=False,
        )
        self.rotary_emb = LlamaRotaryEmbedding(config=self.config)

    def forward(self, hidden_states, position_ids=None, unpadded_lengths=None):
        h_size = hidden_states.size(-1)

        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)

        q = q.view(*q.shape[:-1], self.num_heads, self.head_dim)
        k = k.view(*k.shape[:-1], self.num_key_value_heads, self.head_dim)
        v = v.view(*v.shape[:-1], self.num_key_value_heads, self.head_dim)

        past_len = 0
        # NOTE: Hacky way to include position_ids in sequence parallelism, assuming they are increasing uniformly per block
        if position_ids is not None:
            past_len += position_ids.min()

        if unpadded_lengths is not None:
            # We don't use the unpadded_length during rotary embeds and instead create a temporary `batch` dimension
            # This does not actually affect the otucome since the positional embeddings are relative and stay valid
            q, k = self.rotary_emb(q.unsqueeze(0), k.unsqueeze(0), past_len)
            q, k = q.squeeze(0), k.squeeze(0)
        else:
            q, k = self.rotary_emb(q, k, past_len)

        kv = torch.stack([k, v], -3)
        kv = repeat_kv(kv, self.num_key_value_groups)

        if unpadded_lengths is not None:
            # varlen, ignore padding tokens, efficient for large batch with many paddings
            cu_seqlens, max_seqlen = unpadded_lengths

            attn_output = flash_attn_varlen_kvpacked_func(
                q, kv,
                cu_seqlens, cu_seqlens,
                max_seqlen, max_seqlen,
                dropout_p=0.0, softmax_scale=1.0 / self.norm_factor,
                causal=True,
            )
        else:
            attn_output = flash_attn_kvpacked_func(
                q, kv,
                dropout_p=0.0,
                softmax_scale=1.0 / self.norm_factor,
                causal=True,
            )

        attn_output = attn_output.reshape(*attn_output.shape[:-2], h_size)
        return self.o_proj(attn_output)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(config=config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_ids=None, unpadded_lengths=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_ids=position_ids,
                                       unpadded_lengths=unpadded_lengths)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, position_ids=None, unpadded_lengths=None):
        hidden_states = self.embed_tokens(input_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, position_ids=position_ids,
                                          unpadded_lengths=unpadded_lengths)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=std)

    def compute_loss(self, hidden_states, labels, token_losses=False):
        logits = self.lm_head(hidden_states)
        if len(logits.shape) > 2:
            logits = logits.transpose(-1, -2)
        return F.cross_entropy(
            logits, labels,
            ignore_index=-100,
            reduction=("none" if token_losses else "mean")
        )

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None,
                use_cache=False, seq_lengths=None):
        if seq_lengths is not None:
            assert len(input_ids.shape) == 1, "input_ids should be a 1D tensor with `seq_lengths`"
            assert attention_mask is None or attention_mask.all().item(), "attention_mask should be None or all ones for `seq_lengths`"
            assert not use_cache, "use_cache is not supported with `seq_lengths`"

            cu_seqlens = F.pad(torch.cumsum(seq_lengths, dim=0, dtype=torch.torch.int32), (1, 0))
            max_seqlen = seq_lengths.max().item()

            unpadded_lengths = (cu_seqlens, max_seqlen)
        else:
            unpadded_lengths = None

        hidden_states = self.model(input_ids, position_ids=position_ids, unpadded_lengths=unpadded_lengths)

        loss = None
        if labels is not None:
            labels = labels[..., 1:].reshape(-1)
            loss = self.compute_loss(hidden_states[..., :-1, :].reshape(-1, hidden_states.size(-1)), labels)
        return loss, self.lm_head(hidden_states)


# ---------------------------------------------------------------- one training step

class TinyTokenizer:
    bos_token_id = 1
    eos_token_id = 2


def make_item(generator, doc_lengths, vocab_size):
    """A streamed item as ProLong's MDS shards hold it: documents concatenated, `indices`
    the (start, end) span of each, every document BOS ... EOS."""
    input_ids, indices = [], []
    for n in doc_lengths:
        body = torch.randint(3, vocab_size, (n - 2,), generator=generator).tolist()
        indices.append((len(input_ids), len(input_ids) + n))
        input_ids += [TinyTokenizer.bos_token_id] + body + [TinyTokenizer.eos_token_id]
    return {"input_ids": input_ids, "indices": indices}


def main():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    generator = torch.Generator().manual_seed(1)
    features = [make_item(generator, [7, 12, 5], config.vocab_size),
                make_item(generator, [16, 9], config.vocab_size)]
    collator = DataCollator(TinyTokenizer(), DataArguments())
    batch = collator(features)
    print("seq_lengths", batch["seq_lengths"].tolist(), "total tokens", batch["input_ids"].numel())

    # reference: every document alone, a batch of one with positions from 0, plain causal attention
    documents = [torch.tensor(item["input_ids"][a:b]) for item in features for a, b in item["indices"]]
    ref_logits, ref_token_losses = [], []
    for doc in documents:
        _, logits = model(doc[None])
        ref_logits.append(logits[0])
        ref_token_losses.append(F.cross_entropy(logits[0, :-1], doc[1:], reduction="none"))
    ref_loss = torch.cat(ref_token_losses).mean()
    ref_loss.backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    # ProLong's step: the packed stream, seq_lengths -> cu_seqlens -> varlen attention
    loss, logits = model(**batch)
    loss.backward()

    torch.testing.assert_close(logits, torch.cat(ref_logits), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    n_targets = (batch["labels"][1:] != -100).sum().item()
    assert n_targets == sum(len(d) - 1 for d in documents)

    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    print(f"loss {loss.item():.6f} (documents alone {ref_loss.item():.6f}), {n_targets} targets; "
          "logits and gradients match each document run alone")


if __name__ == "__main__":
    main()
