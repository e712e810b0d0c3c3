# NVIDIA-NeMo/Automodel#2116 (commit 2afd94eed, "fix(gemma4): Gemma4 packing, attention mask, and
# fixes MoE routing").
#
# VLM neat packing: `neat_packed_vlm_collater` turns the indexed packed mask (1, 1, 2, 2, 2, 0, ...)
# into a 4D block-causal *bool* mask (`_indexed_mask_to_4d_block_causal`, True = may attend) for the
# sdpa / eager backends. Gemma4MoETextModelBackend.forward handed that mask to transformers'
# create_causal_mask / create_sliding_window_causal_mask, which return a 4D mask as it is, and the
# eager attention adds it to the scores: +1 where allowed, +0 where not, so nothing is masked.
# Fix: the backend converts a 4D bool mask to an additive one (0 allowed, finfo.min masked) before
# the layers, and derives the 2D padding mask from the 4D mask's diagonal.
#
# Ported trimmed: the text backend with a dense MLP per layer (the NeMo MoE block, which only reads the
# padding mask for routing, is left out), Gemma4TextConfig with eager attention, random weights.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

FIXED = "--fixed" in sys.argv


# ---- nemo_automodel/components/datasets/utils.py -------------------------------------------------
def _indexed_mask_to_4d_block_causal(attention_mask: torch.Tensor) -> torch.Tensor:
    B, S = attention_mask.shape
    mask_q = attention_mask.unsqueeze(2)  # [B, S, 1]
    mask_k = attention_mask.unsqueeze(1)  # [B, 1, S]
    same_doc = mask_q == mask_k  # [B, S, S]
    causal = torch.ones(S, S, dtype=torch.bool, device=attention_mask.device).tril()  # [S, S]
    not_padding_q = (attention_mask > 0).unsqueeze(2)  # [B, S, 1]
    not_padding_k = (attention_mask > 0).unsqueeze(1)  # [B, 1, S]
    mask_4d = same_doc & causal.unsqueeze(0) & not_padding_q & not_padding_k  # [B, S, S]
    return mask_4d.unsqueeze(1)  # [B, 1, S, S]


# ---- nemo_automodel/components/datasets/vlm/collate_fns.py ---------------------------------------
def neat_packed_vlm_collater(batch, padding_idx=0, max_length=None, attn_implementation="sdpa"):
    LABEL_PAD = -100
    use_flash = attn_implementation == "flash_attention_2"
    batch_max = max(len(x["input_ids"]) for x in batch)
    max_len = max_length if max_length is not None else batch_max

    def _pad_1d(tensor, pad_value, target_len):
        t = torch.as_tensor(tensor)
        pad_len = target_len - t.shape[0]
        if pad_len > 0:
            return torch.cat([t, torch.full((pad_len,), pad_value, dtype=t.dtype)])
        return t

    input_ids = torch.stack([_pad_1d(x["input_ids"], padding_idx, max_len) for x in batch])
    labels = torch.stack([_pad_1d(x["labels"], LABEL_PAD, max_len) for x in batch])
    attention_mask = torch.stack([_pad_1d(x["attention_mask"], 0, max_len) for x in batch])
    if use_flash:
        attention_mask_out = attention_mask
    else:
        attention_mask_out = _indexed_mask_to_4d_block_causal(attention_mask)
    position_ids = torch.stack([_pad_1d(x["position_ids"], 0, max_len) for x in batch])
    result = {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "attention_mask": attention_mask_out,
    }
    if attention_mask.max() > 1:
        result["_packed_seq_ids"] = attention_mask
    return result


# ---- nemo_automodel/components/models/gemma4_moe/model.py (fix helpers) -------------------------
def _convert_bool_4d_mask_to_additive(attention_mask, dtype):
    if attention_mask.ndim != 4 or attention_mask.dtype != torch.bool:
        return attention_mask
    additive = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
    return additive.masked_fill(~attention_mask, torch.finfo(dtype).min)


def _derive_padding_mask(attention_mask):
    if attention_mask.ndim == 2:
        return attention_mask == 0
    if attention_mask.ndim == 4:
        diagonal = torch.diagonal(attention_mask[:, 0], dim1=-2, dim2=-1)
        if attention_mask.dtype == torch.bool:
            return diagonal.logical_not()
        return diagonal != 0
    return attention_mask.bool().logical_not()


# ---- the HF pieces the backend reuses (Gemma4 eager attention, RMSNorm, rotary), written small ----
class Gemma4RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class Gemma4RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        inv = 1.0 / (10000.0 ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x, position_ids, layer_type=None):
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(hidden_states, n_rep):
    b, h, s, d = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    return hidden_states[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def eager_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None):
    if scaling is None:
        scaling = module.head_dim**-0.5
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if softcap is not None:
        attn_weights = torch.tanh(attn_weights / softcap) * softcap
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


class Gemma4Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out, w = eager_attention_forward(self, q, k, v, attention_mask, scaling=1.0)
        return self.o_proj(out.reshape(b, s, -1)), w


class Gemma4MLP(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma4MoEDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = Gemma4Attention(config=config, layer_idx=layer_idx)
        self.mlp = Gemma4MLP(config, layer_idx)
        self.input_layernorm = Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, *, position_embeddings, attention_mask=None, position_ids=None, padding_mask=None, **kw):
        residual = x
        x = self.input_layernorm(x)
        x, _ = self.self_attn(hidden_states=x, position_embeddings=position_embeddings, attention_mask=attention_mask)
        x = self.post_attention_layernorm(x)
        x = residual + x
        residual = x
        x = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return residual + x


class Gemma4MoETextModelBackend(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleDict(
            {str(i): Gemma4MoEDecoderLayer(config, i) for i in range(config.num_hidden_layers)}
        )
        self.norm = Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Gemma4RotaryEmbedding(config)

    def forward(self, input_ids=None, *, attention_mask=None, position_ids=None, padding_mask=None, **kwargs):
        inputs_embeds = self.embed_tokens(input_ids) * self.config.hidden_size**0.5
        cache_position = torch.arange(0, inputs_embeds.shape[1], device=inputs_embeds.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)

        if FIXED:
            if padding_mask is None and attention_mask is not None:
                padding_mask = _derive_padding_mask(attention_mask)
            if attention_mask is not None:
                attention_mask = _convert_bool_4d_mask_to_additive(attention_mask, inputs_embeds.dtype)
        else:
            if padding_mask is None and attention_mask is not None:
                padding_mask = attention_mask.bool().logical_not()

        hidden_states = inputs_embeds
        mask_kwargs = {
            "config": self.config,
            "inputs_embeds": inputs_embeds,
            "attention_mask": attention_mask,
            "past_key_values": None,
            "position_ids": position_ids,
        }
        causal_mask_mapping = {
            "full_attention": create_causal_mask(**mask_kwargs),
            "sliding_attention": create_sliding_window_causal_mask(**mask_kwargs),
        }
        position_embeddings = {}
        for layer_type in set(self.config.layer_types):
            position_embeddings[layer_type] = self.rotary_emb(hidden_states, position_ids, layer_type)
        for decoder_layer in self.layers.values():
            hidden_states = decoder_layer(
                hidden_states,
                position_embeddings=position_embeddings[decoder_layer.attention_type],
                attention_mask=causal_mask_mapping[decoder_layer.attention_type],
                position_ids=position_ids,
                padding_mask=padding_mask,
            )
        return self.norm(hidden_states)


def main():
    torch.manual_seed(0)
    config = Gemma4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64, pad_token_id=0,
    )
    config._attn_implementation = "eager"
    config.allow_global_per_layer_attribute_access = True
    model = Gemma4MoETextModelBackend(config).eval()
    lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    # Two packs from PackedDatasetWrapper (already shifted): documents of 4 + 3 and 5 tokens.
    packs = []
    for lens in ([4, 3], [5]):
        ids = torch.randint(1, config.vocab_size, (sum(lens),))
        packs.append({
            "input_ids": ids,
            "labels": torch.roll(ids, -1),
            "attention_mask": torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lens)]),
            "position_ids": torch.cat([torch.arange(n) for n in lens]),
        })
    batch = neat_packed_vlm_collater(packs, padding_idx=0, attn_implementation="eager")

    with torch.no_grad():
        hidden = model(batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
        logits = lm_head(hidden)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), batch["labels"].view(-1), ignore_index=-100)
    print("loss", round(loss.item(), 6))
    print("second document's first token, first logits:", [round(v, 4) for v in logits[0, 4, :4].tolist()])


if __name__ == "__main__":
    main()
