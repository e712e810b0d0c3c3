# unslothai/unsloth#8253 (commit 7088df88ea): "Carry the sliding window into SDPA, and treat a zero window as no window"
# Training a Mistral-style model with neither FlashAttention nor xFormers: MistralForCausalLM_fast_forward builds no
# mask in training (`elif self.training: pass`), LlamaModel_fast_forward drops the 2D attention_mask, and
# MistralAttention_fast_forward handed run_attention no sliding_window, so SDPA ran with is_causal=True: every query
# attended its whole causal history past config.sliding_window. The fix passes `sliding_window=sw` in the
# AttentionContext and run_attention builds the causal band mask (`_windowed_causal_mask`) when there is no other mask.
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import MistralConfig, MistralForCausalLM
from transformers.models.mistral import modeling_mistral

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

HAS_FLASH_ATTENTION = False  # no flash_attn wheel
HAS_XFORMERS = False         # xformers absent / no kernel for this device
SDPA_HAS_GQA = True
FLASH_DENSE, FLASH_VARLEN, XFORMERS, SDPA = "flash_dense", "flash_varlen", "xformers", "sdpa"
SDPA_CALLS = []


# ---- unsloth/utils/attention_dispatch.py ----
@dataclass
class AttentionConfig:
    backend: str
    n_kv_heads: int
    n_groups: int
    flash_dense_kwargs: Optional[dict] = None
    flash_varlen_kwargs: Optional[dict] = None
    sdpa_kwargs: Optional[dict] = None
    xformers_kwargs: Optional[dict] = None


@dataclass
class AttentionContext:
    bsz: int
    q_len: int
    kv_seq_len: int
    n_heads: int
    head_dim: int
    requires_grad: bool
    seq_info: Optional[Any]
    attention_mask: Optional[Tensor]
    causal_mask: Optional[Any]
    sliding_window: Optional[int] = None


def select_attention_backend(use_varlen: bool = False) -> str:
    if HAS_FLASH_ATTENTION:
        return FLASH_VARLEN if use_varlen else FLASH_DENSE
    if HAS_XFORMERS:
        return XFORMERS
    return SDPA


def _windowed_causal_mask(q_len, k_len, sliding_window, device):
    q_pos = torch.arange(k_len - q_len, k_len, device=device)
    k_pos = torch.arange(k_len, device=device)
    return ((k_pos[None, :] <= q_pos[:, None])
            & (k_pos[None, :] >= (q_pos[:, None] - (sliding_window - 1))))[None, None, :, :]


def run_attention(*, config: AttentionConfig, context: AttentionContext, Q: Tensor, K: Tensor, V: Tensor) -> Tensor:
    # SDPA branch (flash / xformers unavailable here)
    sdpa_kwargs = config.sdpa_kwargs or {}
    bsz, n_heads, head_dim = context.bsz, context.n_heads, context.head_dim
    kv_seq_len = context.kv_seq_len
    requires_grad = context.requires_grad
    sliding_window = context.sliding_window
    if sliding_window is not None and sliding_window <= 0:
        sliding_window = None

    local_mask = context.attention_mask
    q_len_local = Q.shape[-2]
    k_len_local = K.shape[-2]
    if local_mask is not None and local_mask.dim() == 2:
        key_keep = local_mask != 0
        past_len = k_len_local - q_len_local
        q_pos = torch.arange(past_len, past_len + q_len_local, device=Q.device)
        k_pos = torch.arange(k_len_local, device=Q.device)
        causal_keep = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            causal_keep &= k_pos[None, :] >= (q_pos[:, None] - (sliding_window - 1))
        local_mask = causal_keep[None, None, :, :] & key_keep[:, None, None, :]
        no_allowed = ~local_mask.any(dim=-1, keepdim=True)
        local_mask = local_mask | no_allowed

    if FIXED:
        if local_mask is None and sliding_window is not None and k_len_local > sliding_window:
            # SDPA's is_causal is FULL causal; it has no window.
            local_mask = _windowed_causal_mask(q_len_local, k_len_local, sliding_window, Q.device)

    is_causal_local = local_mask is None and q_len_local == k_len_local

    kwargs = dict(sdpa_kwargs)
    kwargs.setdefault("attn_mask", local_mask)
    kwargs.setdefault("is_causal", is_causal_local)
    SDPA_CALLS.append((kwargs["attn_mask"], kwargs["is_causal"]))

    use_sdpa_gqa = SDPA_HAS_GQA and config.n_groups != 1
    if use_sdpa_gqa:
        kwargs.setdefault("enable_gqa", True)
        out = F.scaled_dot_product_attention(Q, K, V, **kwargs)
        return out.transpose(1, 2)
    out = F.scaled_dot_product_attention(Q.contiguous(), K.contiguous(), V.contiguous(), **kwargs)
    return out.transpose(1, 2).contiguous()


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


# ---- unsloth/models/mistral.py MistralAttention_fast_forward ----
def MistralAttention_fast_forward(self, hidden_states, causal_mask=None, attention_mask=None, position_ids=None,
                                  past_key_value=None, position_embeddings=None, **kwargs):
    bsz, q_len, _ = hidden_states.size()
    n_heads = self.config.num_attention_heads
    n_groups = self.num_key_value_groups
    n_kv_heads = self.config.num_key_value_heads
    head_dim = self.head_dim
    Q = self.q_proj(hidden_states).view(bsz, q_len, n_heads, head_dim).transpose(1, 2)
    K = self.k_proj(hidden_states).view(bsz, q_len, n_kv_heads, head_dim).transpose(1, 2)
    V = self.v_proj(hidden_states).view(bsz, q_len, n_kv_heads, head_dim).transpose(1, 2)
    seq_info = None  # no packed_seq_lengths in kwargs
    kv_seq_len = K.shape[-2]
    cos, sin = position_embeddings
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    Q = Q * cos + rotate_half(Q) * sin
    K = K * cos + rotate_half(K) * sin

    # Attention module
    sw_cfg = getattr(self.config, "sliding_window", None)
    sw = kv_seq_len if (sw_cfg is None or sw_cfg == "null") else sw_cfg
    window_size = (-1, -1) if (kv_seq_len <= sw) else (sw, sw)

    use_varlen = seq_info is not None and past_key_value is None and window_size == (-1, -1)
    backend = SDPA if attention_mask is not None else select_attention_backend(use_varlen)
    attention_config = AttentionConfig(
        backend=backend, n_kv_heads=n_kv_heads, n_groups=n_groups,
        flash_dense_kwargs={"causal": True, "window_size": window_size},
    )
    context_kwargs = dict(
        bsz=bsz, q_len=q_len, kv_seq_len=kv_seq_len, n_heads=n_heads, head_dim=head_dim,
        requires_grad=hidden_states.requires_grad, seq_info=seq_info,
        attention_mask=attention_mask, causal_mask=causal_mask,
    )
    if FIXED:
        context_kwargs["sliding_window"] = None if window_size == (-1, -1) else sw
    context = AttentionContext(**context_kwargs)
    A = run_attention(config=attention_config, context=context, Q=Q, K=K, V=V)
    attn_output = A.reshape(bsz, q_len, n_heads * head_dim)
    return self.o_proj(attn_output), None


# ---- unsloth/models/llama.py LlamaDecoderLayer_fast_forward / LlamaModel_fast_forward (mask parts) ----
def LlamaDecoderLayer_fast_forward(self, hidden_states, causal_mask=None, attention_mask=None, position_ids=None,
                                   position_embeddings=None, **kwargs):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states, causal_mask=causal_mask, attention_mask=attention_mask,
                                      position_ids=position_ids, position_embeddings=position_embeddings)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    return residual + self.mlp(hidden_states)


def LlamaModel_fast_forward(self, input_ids, causal_mask=None, attention_mask=None, position_ids=None, **kwargs):
    batch_size, seq_length = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(seq_length)[None].repeat(batch_size, 1)
    inputs_embeds = self.embed_tokens(input_ids)
    # Ignore attention_mask
    if attention_mask is None:
        padding_mask = None
    elif self.training:
        attention_mask = None
        padding_mask = None
    hidden_states = inputs_embeds
    position_embeddings = self.rotary_emb(hidden_states, position_ids)
    for decoder_layer in self.layers:
        hidden_states = decoder_layer(hidden_states, causal_mask=causal_mask, attention_mask=attention_mask,
                                      position_ids=position_ids, position_embeddings=position_embeddings)
    return self.norm(hidden_states)


# ---- unsloth/models/mistral.py MistralForCausalLM_fast_forward (training, no xformers) ----
def MistralForCausalLM_fast_forward(self, input_ids=None, causal_mask=None, attention_mask=None,
                                    position_ids=None, labels=None, **kwargs):
    if causal_mask is None:
        bsz, q_len = input_ids.shape
        sliding_window = getattr(self.config, "sliding_window", None)
        if HAS_XFORMERS:
            raise RuntimeError("not on this machine")
        elif self.training:
            # LlamaModel_fast_forward's DPO embed-masking block needs the 2D attention_mask;
            # it nulls the mask before attention anyway
            pass
    self.model._has_no_labels = labels is None
    hidden_states = self.model(input_ids, causal_mask=causal_mask, attention_mask=attention_mask,
                               position_ids=position_ids)
    logits = self.lm_head(hidden_states)
    loss = None
    if labels is not None:
        shift_logits = logits[:, :-1, :].reshape(-1, logits.shape[-1])
        shift_labels = labels[:, 1:].reshape(-1)
        loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
    return loss, logits


# FastMistralModel.pre_patch
modeling_mistral.MistralAttention.forward = MistralAttention_fast_forward
modeling_mistral.MistralDecoderLayer.forward = LlamaDecoderLayer_fast_forward
modeling_mistral.MistralModel.forward = LlamaModel_fast_forward
modeling_mistral.MistralForCausalLM.forward = MistralForCausalLM_fast_forward

config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                       max_position_embeddings=64)
model = MistralForCausalLM(config)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

# one SFT training step on a (full-length, unpadded) batch of 12 tokens, longer than sliding_window=4
input_ids = torch.randint(1, 64, (2, 12))
batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}
loss, logits = model(**batch)
loss.backward()
optimizer.step()
optimizer.zero_grad()

attn_mask, is_causal = SDPA_CALLS[0]
if attn_mask is None:
    visible_last = 12 if is_causal else None
else:
    visible_last = int(attn_mask[0, 0, -1].sum())
print("fixed" if FIXED else "buggy", "| SDPA attn_mask:", None if attn_mask is None else tuple(attn_mask.shape),
      "is_causal:", is_causal, "| keys visible to the last query:", visible_last,
      "(sliding_window=%d)" % config.sliding_window, "| loss %.4f" % loss.item())
