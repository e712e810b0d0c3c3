# Citation: hao-ai-lab/FastVideo commit cceacec99 ("[fix]: preserve causal masks in FlashAttention").
# Upstream: fastvideo/models/encoders/mmaudio_clip.py (MMAudioDFNCLIPTextEncoder.forward builds an
# additive triangular mask and hands it to the attention layers through SDPAMetadata),
# fastvideo/attention/backends/flash_attn.py (_key_padding_mask_from_attn_mask,
# FlashAttentionImpl._forward_impl), fastvideo/attention/utils/flash_attn_no_pad.py (flash_attn_no_pad).
# Bug: MMAudio's CLIP text encoder (config is_causal=False) passes OpenCLIP's additive causal mask
# [1, 1, S, S] as attn_mask. On the FLASH_ATTN backend the mask is read as a key-padding mask:
# `attn_mask[:, 0, 0, :]` keeps only the first query row ([0, -inf, -inf, ...]), so `>= 0` keeps one
# key, and flash_attn_no_pad runs with causal=False over that single token and pads the rest back.
# Fix: SDPAMetadata gets `is_causal`; the encoder sets is_causal=True and the backend routes such a
# mask to native causal flash attention (flash_attn_func(causal=True)); the no-pad path passes
# causal=self.causal and 3D/4D masks that are not [B, 1, 1, K] are rejected.
# flash_attn / flash_attn.bert_padding are written below in plain torch with the same signatures.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------------------------------------------------------- flash_attn stand-ins (plain torch)
def unpad_input(hidden_states, attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = seqlens_in_batch
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item())
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def pad_input(hidden_states, indices, batch, seqlen):
    output = torch.zeros(batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype)
    output[indices] = hidden_states
    return output.reshape(batch, seqlen, *hidden_states.shape[1:])


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, deterministic=False):
    out = torch.empty(qkv.shape[0], qkv.shape[2], qkv.shape[3], dtype=qkv.dtype)
    for i in range(cu_seqlens.numel() - 1):
        s, e = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
        if e == s:
            continue
        q, k, v = (qkv[s:e, j].transpose(0, 1) for j in range(3))  # [h, n, d]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)
        out[s:e] = o.transpose(0, 1)
    return out


def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
    # q, k, v: [B, S, H, D]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=causal, scale=softmax_scale)
    return o.transpose(1, 2)


flash_attn_func_compilable = flash_attn_func


def flash_attn_no_pad(qkv, key_padding_mask, causal=False, dropout_p=0.0, softmax_scale=None,
                      deterministic=False):
    batch_size = qkv.shape[0]
    seqlen = qkv.shape[1]
    nheads = qkv.shape[-2]
    x = qkv.reshape(batch_size, seqlen, -1)  # "b s three h d -> b s (three h d)"
    x_unpad, indices, cu_seqlens, max_s, used_seqlens_in_batch = unpad_input(x, key_padding_mask)
    x_unpad = x_unpad.reshape(x_unpad.shape[0], 3, nheads, -1)
    output_unpad = flash_attn_varlen_qkvpacked_func(x_unpad, cu_seqlens, max_s, dropout_p,
                                                    softmax_scale=softmax_scale, causal=causal,
                                                    deterministic=deterministic)
    output = pad_input(output_unpad.reshape(output_unpad.shape[0], -1), indices, batch_size, seqlen)
    return output.reshape(batch_size, seqlen, nheads, -1)


# ---------------------------------------------------------------- forward context / metadata
@dataclass
class SDPAMetadata:
    current_timestep: int
    attn_mask: torch.Tensor | None = None
    # The mask is exactly native causal attention, with no additional padding.
    is_causal: bool = False


_FORWARD_CONTEXT = {"attn_metadata": None}


class set_forward_context:
    def __init__(self, current_timestep, attn_metadata):
        self.attn_metadata = attn_metadata

    def __enter__(self):
        self.prev = _FORWARD_CONTEXT["attn_metadata"]
        _FORWARD_CONTEXT["attn_metadata"] = self.attn_metadata

    def __exit__(self, *exc):
        _FORWARD_CONTEXT["attn_metadata"] = self.prev


# ---------------------------------------------------------------- FLASH_ATTN backend
def _key_padding_mask_from_attn_mask(attn_mask, key_len):
    # Normalize attn_mask to [B, key_len] where True means valid token.
    if attn_mask.dim() == 4:
        if FIXED and (attn_mask.shape[1] != 1 or attn_mask.shape[-2] != 1):
            raise ValueError("FLASH_ATTN only supports 4D key-padding masks with shape [B, 1, 1, K]")
        attn_mask = attn_mask[:, 0, 0, :]
    elif attn_mask.dim() == 3:
        if FIXED and attn_mask.shape[-2] != 1:
            raise ValueError("FLASH_ATTN only supports 3D key-padding masks with shape [B, 1, K]")
        attn_mask = attn_mask[:, 0, :]
    elif attn_mask.dim() != 2:
        raise ValueError(f"Unsupported attn_mask shape for FLASH_ATTN: {attn_mask.shape}")

    # SDPA additive mask convention: valid=0, masked=-inf/large negative.
    key_padding_mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask >= 0

    if key_padding_mask.shape[-1] != key_len:
        raise ValueError("Invalid key padding mask length for FLASH_ATTN: "
                         f"expected {key_len}, got {key_padding_mask.shape[-1]}")
    return key_padding_mask


class FlashAttentionImpl:
    def __init__(self, num_heads, head_size, causal, softmax_scale, num_kv_heads=None, **extra):
        self.causal = causal
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attn_metadata):
        orig_dtype = query.dtype
        if orig_dtype not in (torch.float16, torch.bfloat16):
            query = query.to(torch.bfloat16)
            key = key.to(torch.bfloat16)
            value = value.to(torch.bfloat16)
        output = self._forward_impl(query, key, value, attn_metadata)
        if output.dtype != orig_dtype:
            output = output.to(orig_dtype)
        return output

    def _forward_impl(self, query, key, value, attn_metadata):
        if attn_metadata is not None and getattr(attn_metadata, "attn_mask", None) is not None:
            attn_mask = attn_metadata.attn_mask
            if FIXED and getattr(attn_metadata, "is_causal", False):
                return flash_attn_func_compilable(query, key, value, softmax_scale=self.softmax_scale,
                                                  causal=True)
            if query.shape[1] != key.shape[1]:
                raise NotImplementedError("cross-attention path not used here")
            qkv = torch.stack([query, key, value], dim=2)
            key_padding_mask = _key_padding_mask_from_attn_mask(attn_mask, attn_mask.shape[-1])
            if key_padding_mask.shape[-1] > qkv.shape[1]:
                raise ValueError("Invalid key padding mask length for FLASH_ATTN")
            attn_mask_padded = F.pad(key_padding_mask, (qkv.shape[1] - key_padding_mask.shape[-1], 0), value=True)
            causal = self.causal if FIXED else False
            output = flash_attn_no_pad(qkv, attn_mask_padded, causal=causal, dropout_p=0, softmax_scale=None)
        else:
            output = flash_attn_func_compilable(query, key, value, softmax_scale=self.softmax_scale,
                                                causal=self.causal)
        return output


class LocalAttention(nn.Module):
    def __init__(self, num_heads, head_size, num_kv_heads=None, softmax_scale=None, causal=False):
        super().__init__()
        self.softmax_scale = head_size ** -0.5 if softmax_scale is None else softmax_scale
        # The layer selector picks FLASH_ATTN when flash-attn is installed.
        self.attn_impl = FlashAttentionImpl(num_heads=num_heads, head_size=head_size,
                                            softmax_scale=self.softmax_scale, causal=causal)

    def forward(self, q, k, v):
        assert q.dim() == 4 and k.dim() == 4 and v.dim() == 4, "Expected 4D tensors"
        attn_metadata = _FORWARD_CONTEXT["attn_metadata"]
        return self.attn_impl.forward(q, k, v, attn_metadata)


# ---------------------------------------------------------------- CLIP text model (FastVideo clip.py, tiny)
@dataclass
class MMAudioDFNCLIPTextConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 12
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 0
    bos_token_id: int = 62
    eos_token_id: int = 63
    # OpenCLIP supplies an explicit additive triangular mask; the adapter does not use is_causal.
    is_causal: bool = False


class CLIPTextEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)),
                             persistent=False)

    def forward(self, input_ids, position_ids=None):
        seq_length = input_ids.shape[-1]
        if position_ids is None:
            position_ids = self.position_ids[:, :seq_length]
        return self.token_embedding(input_ids) + self.position_embedding(position_ids)


class CLIPAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.qkv_proj = nn.Linear(self.embed_dim, 3 * self.embed_dim)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.attn = LocalAttention(self.num_heads, self.head_dim, self.num_heads, softmax_scale=None,
                                   causal=config.is_causal)

    def forward(self, hidden_states):
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)
        b, s = q.shape[:2]
        q = q.reshape(b, s, self.num_heads, self.head_dim)
        k = k.reshape(b, s, self.num_heads, self.head_dim)
        v = v.reshape(b, s, self.num_heads, self.head_dim)
        attn_output = self.attn(q, k, v)
        attn_output = attn_output.reshape(b, s, self.num_heads * self.head_dim)
        return self.out_proj(attn_output), None


class CLIPMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        x = self.fc1(x)
        x = x * torch.sigmoid(1.702 * x)  # quick_gelu
        return self.fc2(x)


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = CLIPAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.layer_norm1(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.layer_norm2(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class CLIPTextTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = CLIPTextEmbeddings(config)
        self.layers = nn.ModuleList([CLIPEncoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.eos_token_id = config.eos_token_id

    def forward(self, input_ids, position_ids=None, attention_mask=None):
        hidden_states = self.embeddings(input_ids=input_ids, position_ids=position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        last_hidden_state = self.final_layer_norm(hidden_states)
        pooled_output = last_hidden_state[
            torch.arange(last_hidden_state.shape[0]),
            (input_ids.to(dtype=torch.int) == self.eos_token_id).int().argmax(dim=-1),
        ]
        return last_hidden_state, pooled_output


class CLIPTextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.text_model = CLIPTextTransformer(config)

    def forward(self, input_ids, position_ids=None, attention_mask=None):
        return self.text_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


class MMAudioDFNCLIPTextEncoder(CLIPTextModel):
    """Return normalized CLIP hidden states for every text token."""

    def forward(self, input_ids, position_ids=None, attention_mask=None):
        sequence_length = input_ids.shape[-1]
        model_dtype = next(self.parameters()).dtype
        causal_mask = torch.empty((sequence_length, sequence_length), dtype=model_dtype)
        causal_mask.fill_(float("-inf"))
        causal_mask.triu_(1)
        if FIXED:
            metadata = SDPAMetadata(current_timestep=0, attn_mask=causal_mask[None, None], is_causal=True)
        else:
            metadata = SDPAMetadata(current_timestep=0, attn_mask=causal_mask[None, None])
        with set_forward_context(current_timestep=0, attn_metadata=metadata):
            last_hidden_state, pooler_output = super().forward(input_ids=input_ids, position_ids=position_ids,
                                                               attention_mask=attention_mask)
        normalized = F.normalize(last_hidden_state, dim=-1)
        return normalized, pooler_output


# ---------------------------------------------------------------- run: MMAudio text conditioning
config = MMAudioDFNCLIPTextConfig()
encoder = MMAudioDFNCLIPTextEncoder(config).eval()

# two prompts, OpenCLIP style: <bos> tokens <eos> then zero padding to text_len
prompts = [[11, 23, 5, 40, 17], [9, 31, 2]]
L = config.max_position_embeddings
input_ids = torch.zeros(len(prompts), L, dtype=torch.long)
for i, p in enumerate(prompts):
    ids = [config.bos_token_id] + p + [config.eos_token_id]
    input_ids[i, :len(ids)] = torch.tensor(ids)

# a small conditioning readout: audio latent queries cross-attend the text features (as MMAudio's
# joint blocks consume them), to show what the text features carry downstream
text_proj = nn.Linear(config.hidden_size, 16)
latent_queries = torch.randn(1, 6, 16)

with torch.no_grad():
    text_features, pooled = encoder(input_ids)
    kv = text_proj(text_features)
    cond = F.scaled_dot_product_attention(latent_queries.expand(kv.shape[0], -1, -1), kv, kv)

print("mode:", "fixed" if FIXED else "buggy")
print("text_features[0, :4, :3]:\n", text_features[0, :4, :3])
print("text_features[1, :4, :3]:\n", text_features[1, :4, :3])
print("pooled (eot) norm per prompt:", pooled.norm(dim=-1))
print("conditioning readout mean/std:", cond.mean().item(), cond.std().item())
