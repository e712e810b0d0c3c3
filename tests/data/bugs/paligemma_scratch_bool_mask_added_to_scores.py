"""YYZhang2025/Pali-Gemma commit 55a5faf ("fix bug"), a from-scratch PaliGemma (SigLIP + Gemma) teaching repo,
fine-tuned with teacher forcing (finetune_cord.py: train_step, build_labels).

Bug (code at 54ce9d9, from 03f0a1b): _merge_input_ids_with_image_features now builds the prefill mask as a
bool tensor (tril causal & key_keep from the batch's attention_mask), but GemmaAttention still adds it to the
scores (`attn = attn + attention_mask`), as it did with the old all-zero float mask: allowed pairs get +1,
blocked pairs +0, so the suffix tokens see the tokens after them and the right padding while training.
Fix (55a5faf): GemmaAttention fills with -inf where the bool mask is False
(`attn.masked_fill_(~attention_mask, float("-inf"))`), and the decode mask becomes a bool tensor of ones.

Tiny config, random weights, a right-padded batch (load_hf_model loads the tokenizer with padding_side="right")
of image tokens + <bos> + prompt + "\\n" + target + <eos>, as PaliGemmaProcessor lays it out.
"""
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class ModelConfig:
    # Vision Configuration
    vision_num_channels: int = 3
    vision_image_size: int = 28
    vision_patch_size: int = 14
    vision_num_image_tokens: int = 4
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64
    vision_num_hidden_layers: int = 2
    vision_num_attention_heads: int = 4

    vision_layer_norm_eps: float = 1e-6
    vision_attention_dropout: float = 0.0

    # LM Configuration
    lm_vocab_size: int = 300
    lm_hidden_size: int = 32
    lm_intermediate_size: int = 64
    lm_num_hidden_layers: int = 2
    lm_num_attention_heads: int = 4
    lm_num_key_value_heads: int = 1
    lm_num_heads: int = 4
    lm_head_dim: int = 8
    lm_max_position_embeddings: int = 8192
    lm_rms_norm_eps: float = 1e-6
    lm_rope_theta: float = 10000.0
    lm_attention_bias: bool = False
    lm_attention_dropout: float = 0.0

    # Pali Gemma Config
    projection_dim: int = 32

    pad_token_id: int = 0
    bos_token_id: int = 2
    eos_token_id: int = 1
    ignore_index: int = -100
    image_token_index: int = 290
    is_encoder_decoder: bool = False

    def __post_init__(self):
        if self.vision_num_image_tokens is None:
            self.vision_num_image_tokens = (self.vision_image_size // self.vision_patch_size) ** 2
        if self.lm_head_dim is None:
            self.lm_head_dim = self.lm_hidden_size // self.lm_num_attention_heads

        assert (self.vision_num_image_tokens**0.5).is_integer(), (
            "Number of image tokens must be a perfect square"
        )
        assert self.projection_dim == self.lm_hidden_size, "Projection dimension must match LM hidden size"


# ---- kv_cache.py



class KVCache:
    """
    Key-Value Cache for storing attention keys and values for every layer
    The Key/Value shape is:
    [batch_size, num_heads_kv, seq_length, head_dim]
    """

    def __init__(self):
        self.key_cache: List[torch.Tensor] = []
        self.value_cache: List[torch.Tensor] = []

    def num_items(self) -> int:
        if len(self.key_cache) == 0:
            return 0
        return self.key_cache[0].shape[-2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        if len(self.key_cache) <= layer_idx:
            # In the Prefilling stage,
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)

        return self.key_cache[layer_idx], self.value_cache[layer_idx]


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    B, H, S, D = hidden_states.shape

    if n_rep == 1:
        return hidden_states

    expanded = hidden_states[:, :, None, :, :].expand(B, H, n_rep, S, D)

    return expanded.reshape(B, H * n_rep, S, D)
# ---- vision_model.py



class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()

        self.embed_dim = config.vision_hidden_size
        self.image_size = config.vision_image_size
        self.patch_size = config.vision_patch_size

        self.patch_embedding = nn.Conv2d(
            in_channels=config.vision_num_channels,
            out_channels=config.vision_hidden_size,
            kernel_size=config.vision_patch_size,
            stride=config.vision_patch_size,
            padding="valid",
        )

        assert self.image_size % self.patch_size == 0, "Image size must be divisible by patch size"
        num_patches = (self.image_size // self.patch_size) ** 2
        self.num_positions = num_patches
        self.position_embedding = nn.Embedding(self.num_positions, self.embed_dim)
        self.register_buffer(
            "position_ids",
            torch.arange(self.num_positions, dtype=torch.int64).expand((1, -1)),
            persistent=False,
        )

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        # (B, C, H, W) -> (B, C', H', W')
        patch_embeds = self.patch_embedding(imgs)
        # (B, C', H', W') -> (B, H' * W', C')
        patch_embeds = patch_embeds.flatten(2).transpose(1, 2)

        position_embeds = self.position_embedding(self.position_ids)

        return patch_embeds + position_embeds


class SiglipAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()

        self.embed_dim = config.vision_hidden_size
        self.num_heads = config.vision_num_attention_heads

        assert self.embed_dim % self.num_heads == 0, (
            "Embedding dimension must be divisible by number of heads"
        )
        self.head_dim = self.embed_dim // self.num_heads

        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim)

        self.dropout_prob = config.vision_attention_dropout

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, S, D = hidden_states.shape

        q = self.q_proj(hidden_states).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)

        attn_weights = (q @ k.transpose(-2, -1)) * self.head_dim**-0.5
        attn_weights = attn_weights.softmax(dim=-1)

        if self.dropout_prob > 0:
            attn_weights = nn.functional.dropout(attn_weights, p=self.dropout_prob, training=self.training)

        attn_output = (attn_weights @ v).transpose(1, 2).contiguous().view(B, S, D)

        attn_output = self.out_proj(attn_output)

        return attn_output, attn_weights


class SiglipMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()

        self.fc1 = nn.Linear(config.vision_hidden_size, config.vision_intermediate_size)
        self.fc2 = nn.Linear(config.vision_intermediate_size, config.vision_hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.fc1(hidden_states)
        hidden_states = F.gelu(hidden_states, approximate="tanh")
        hidden_states = self.fc2(hidden_states)

        return hidden_states


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()

        self.self_attn = SiglipAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.vision_hidden_size, eps=config.vision_layer_norm_eps)

        self.mlp = SiglipMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.vision_hidden_size, eps=config.vision_layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.layer_norm1(hidden_states)
        attn_output, _ = self.self_attn(hidden_states)
        hidden_states = residual + attn_output

        residual = hidden_states
        hidden_states = self.layer_norm2(hidden_states)
        mlp_output = self.mlp(hidden_states)
        hidden_states = residual + mlp_output

        return hidden_states


class SiglipEncoder(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()

        self.layers = nn.ModuleList(
            [SiglipEncoderLayer(config) for _ in range(config.vision_num_hidden_layers)]
        )

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states)

        return hidden_states


class SiglipVisionTransformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()

        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = SiglipEncoder(config)

        self.post_layernorm = nn.LayerNorm(config.vision_hidden_size, eps=config.vision_layer_norm_eps)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embeddings(imgs)
        hidden_states = self.encoder(hidden_states)
        hidden_states = self.post_layernorm(hidden_states)
        return hidden_states


class SiglipVisionModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()

        self.vision_model = SiglipVisionTransformer(config)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        hidden_states = self.vision_model(imgs)

        return hidden_states
# ---- language_model.py




# TODO: Confirm the behavior of (1.0 + self.weight) and self.weight
class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()

        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        div = torch.rsqrt(torch.sum(x**2, dim=-1, keepdim=True) / x.shape[-1] + self.eps)

        return x * div * (1.0 + self.weight)


class GemmaRotaryEmbedding(nn.Module):
    def __init__(self, dim: int, max_position_embedding: int = 2048, base: float = 10_000):
        super().__init__()

        self.dim = dim
        self.max_position_embedding = max_position_embedding
        self.base = base

        # Calculate the theta
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).float() / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        device = x.device
        device_type = x.device.type
        dtype = x.dtype

        self.inv_freq = self.inv_freq.to(device)
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()

        device_type = device_type if isinstance(device_type, str) and device_type != "mps" else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):
            freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
            # emb: [Batch_Size, Seq_Len, Head_Dim]
            emb = torch.cat((freqs, freqs), dim=-1)
            # cos, sin: [Batch_Size, Seq_Len, Head_Dim]
            cos = emb.cos()
            sin = emb.sin()
        return cos.to(dtype=dtype), sin.to(dtype=dtype)


def rotate_half(x):
    # Build the [-x2, x1, -x4, x3, ...] tensor for the sin part of the positional encoding.
    x1 = x[..., : x.shape[-1] // 2]  # Takes the first half of the last dimension
    x2 = x[..., x.shape[-1] // 2 :]  # Takes the second half of the last dimension
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_embedding(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)  # Unsqueeze for head dimension
    sin = sin.unsqueeze(unsqueeze_dim)  # Unsqueeze for head dimension

    q_embed = q * cos + rotate_half(q) * sin
    k_embed = k * cos + rotate_half(k) * sin

    return q_embed, k_embed


class GemmaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx

        self.q_proj = nn.Linear(
            config.lm_hidden_size,
            config.lm_num_heads * config.lm_head_dim,
            bias=config.lm_attention_bias,
        )
        self.k_proj = nn.Linear(
            config.lm_hidden_size,
            config.lm_num_key_value_heads * config.lm_head_dim,
            bias=config.lm_attention_bias,
        )
        self.v_proj = nn.Linear(
            config.lm_hidden_size,
            config.lm_num_key_value_heads * config.lm_head_dim,
            bias=config.lm_attention_bias,
        )
        self.o_proj = nn.Linear(
            config.lm_num_heads * config.lm_head_dim,
            config.lm_hidden_size,
            bias=config.lm_attention_bias,
        )

        self.rotary_emb = GemmaRotaryEmbedding(
            config.lm_head_dim,
            max_position_embedding=config.lm_max_position_embeddings,
            base=config.lm_rope_theta,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        **kwargs,
    ):
        B, S, D = hidden_states.shape
        d_k = D // self.config.lm_num_heads

        q = (
            self.q_proj(hidden_states)
            .view(B, S, self.config.lm_num_heads, self.config.lm_head_dim)
            .transpose(1, 2)
        )

        k = (
            self.k_proj(hidden_states)
            .view(B, S, self.config.lm_num_key_value_heads, self.config.lm_head_dim)
            .transpose(1, 2)
        )

        v = (
            self.v_proj(hidden_states)
            .view(B, S, self.config.lm_num_key_value_heads, self.config.lm_head_dim)
            .transpose(1, 2)
        )

        cos, sin = self.rotary_emb(v, position_ids)  # HIGHLIGHT: Get cos and sin using value state.
        q, k = apply_rotary_embedding(q, k, cos, sin)

        if kv_cache is not None:
            k, v = kv_cache.update(k, v, self.layer_idx)

        k = repeat_kv(k, self.config.lm_num_heads // self.config.lm_num_key_value_heads)
        v = repeat_kv(v, self.config.lm_num_heads // self.config.lm_num_key_value_heads)

        attn = torch.matmul(q, k.transpose(-2, -1)) / (d_k**0.5)

        assert attention_mask is not None
        if FIXED:
            attn = attn.masked_fill_(~attention_mask, value=float("-inf"))
        else:
            attn = attn + attention_mask

        attn = attn.softmax(dim=-1)
        attn = F.dropout(attn, p=self.config.lm_attention_dropout, training=self.training)

        out = torch.matmul(attn, v)
        out = out.transpose(1, 2).contiguous().view(B, S, D)
        out = self.o_proj(out)

        return out, attn


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()

        self.hidden_size = config.lm_hidden_size
        self.intermediate_size = config.lm_intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx

        self.self_attn = GemmaAttention(config, layer_idx)
        self.input_layernorm = GemmaRMSNorm(config.lm_hidden_size, eps=config.lm_rms_norm_eps)

        self.mlp = GemmaMLP(config)
        self.post_attention_layernorm = GemmaRMSNorm(config.lm_hidden_size, eps=config.lm_rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
    ):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            kv_cache=kv_cache,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.lm_vocab_size

        self.embed_tokens = nn.Embedding(self.vocab_size, config.lm_hidden_size, self.padding_idx)

        self.layers = nn.ModuleList(
            [GemmaDecoderLayer(config, layer_idx) for layer_idx in range(config.lm_num_hidden_layers)]
        )
        self.norm = GemmaRMSNorm(config.lm_hidden_size, eps=config.lm_rms_norm_eps)

    def get_input_embeddings(self):
        return self.embed_tokens

    def forward(
        self,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        inputs_embeds: torch.Tensor,
        kv_cache: KVCache,
    ):
        # Normalized
        hidden_states = inputs_embeds * (self.config.lm_hidden_size**0.5)

        for decoder_layer in self.layers:
            # [Batch_Size, Seq_Len, Hidden_Size]
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                kv_cache=kv_cache,
            )

        return self.norm(hidden_states)


class GemmaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()

        self.config = config
        self.model = GemmaModel(config)
        self.vocab_size = config.lm_vocab_size
        self.lm_head = nn.Linear(config.lm_hidden_size, config.lm_vocab_size, bias=False)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(
        self,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        inputs_embeds: torch.Tensor,
        kv_cache: KVCache,
    ) -> Dict[str, Union[torch.Tensor, KVCache]]:
        # input_embeds: [Batch_Size, Seq_Len, Hidden_Size]
        # outputs: [Batch_Size, Seq_Len, Hidden_Size]
        outputs = self.model(
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            kv_cache=kv_cache,
        )

        hidden_states = outputs
        logits = F.linear(hidden_states, self.model.embed_tokens.weight)
        logits = logits.float()

        return_data = {
            "logits": logits,
        }

        if kv_cache is not None:
            # Return the updated cache
            return_data["kv_cache"] = kv_cache

        return return_data
# ---- pali_gemma_model.py




class PaliGemmaMultiModalProjector(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()

        self.linear = nn.Linear(config.vision_hidden_size, config.projection_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class PaliGemmaForConditionalGeneration(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()

        self.config = config
        self.vision_tower = SiglipVisionModel(config)
        self.multi_modal_projector = PaliGemmaMultiModalProjector(config)

        self.vocab_size = config.lm_vocab_size
        self.pad_token_id = self.config.pad_token_id

        self.language_model = GemmaForCausalLM(config)

    def _merge_input_ids_with_image_features(
        self,
        image_features: torch.Tensor,
        inputs_embeds: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        kv_cache: Optional[KVCache] = None,
    ):
        """Merge image features with text inputs.

        Args:
            image_features (torch.Tensor): (B, num_image_tokens, D) The image features to merge.
            inputs_embeds (torch.Tensor): (B, S, D) The text inputs embeddings.
            input_ids (torch.Tensor): (B, S) The input IDs.
            attention_mask (torch.Tensor): (B, S) The attention mask.
            kv_cache (Optional[KVCache], optional): The key-value cache. Defaults to None.

        Returns:
            _type_: _description_
        """

        _, _, embed_dim = image_features.shape
        batch_size, sequence_length = input_ids.shape
        dtype, device = inputs_embeds.dtype, inputs_embeds.device

        # (B, D)
        scaled_image_features = image_features / (self.config.projection_dim**0.5)
        scaled_image_features = scaled_image_features.to(dtype)

        # Combine the embeddings of the
        # - image tokens
        # - text tokens
        # - mask out all the padding tokens
        final_embeddings = torch.zeros(batch_size, sequence_length, embed_dim, dtype=dtype, device=device)

        # Create 3 mask:
        # 1. Text mask: True for text tokens
        # 2. Image mask: True for image tokens
        # 3. Padding mask: True for padding tokens
        # Both has shape: (batch_size, sequence_length)
        text_mask = (input_ids != self.pad_token_id) & (input_ids != self.config.image_token_index)
        image_mask = input_ids == self.config.image_token_index
        padding_mask = input_ids == self.pad_token_id

        # (B, S) => (B, S, D)
        text_mask = text_mask.unsqueeze(-1).expand(-1, -1, embed_dim)
        image_mask = image_mask.unsqueeze(-1).expand(-1, -1, embed_dim)
        padding_mask = padding_mask.unsqueeze(-1).expand(-1, -1, embed_dim)

        # Apply masks to final embeddings
        final_embeddings = torch.where(text_mask, inputs_embeds, final_embeddings)
        final_embeddings = final_embeddings.masked_scatter(image_mask, scaled_image_features)
        final_embeddings = torch.where(padding_mask, torch.zeros_like(final_embeddings), final_embeddings)

        # Create mask for the attention
        q_len = inputs_embeds.shape[1]

        # q_len := inputs_embeds.shape[1], K := q_len if no cache else kv_cache.num_items() + q_len
        if kv_cache is None or kv_cache.num_items() == 0:
            # Prefill: causal lower-triangular AND block pad keys
            # causal_lower: [Q, Q] True on and below diagonal
            causal_lower = torch.tril(torch.ones(q_len, q_len, device=device, dtype=torch.bool))

            # key padding mask: [B, K] True for real tokens (not pad)
            key_keep = attention_mask.to(torch.bool)  # [B, Q] here (K == Q)

            # allow[i, q, k] = causal_lower[q, k] & key_keep[i, k]
            allow = causal_lower.unsqueeze(0) & key_keep.unsqueeze(1)  # [B, Q, Q]
            causal_mask = allow  # [B, Q, Q]
        else:
            # Decode: single query can attend to all cached keys + itself (no future exists)
            assert q_len == 1
            kv_len = kv_cache.num_items() + q_len

            # If your cache never stores pads, you can allow all keys:
            if FIXED:
                causal_mask = torch.ones(
                    (batch_size, q_len, kv_len),  # <-- bool mask, all allowed
                    dtype=torch.bool,
                    device=device,
                )
            else:
                causal_mask = torch.zeros((batch_size, q_len, kv_len), dtype=dtype, device=device)

        # Add head dim: [B, 1, Q, K]
        causal_mask = causal_mask.unsqueeze(1)

        if kv_cache is not None and kv_cache.num_items() > 0:
            # The position of the query is just the last position
            position_ids = attention_mask.cumsum(-1)[:, -1]
            if position_ids.dim() == 1:
                position_ids = position_ids.unsqueeze(0)
        else:
            # Create a position_ids based on the size of the attention_mask
            # For masked tokens, use the number 1 as position.
            position_ids = (attention_mask.cumsum(-1)).masked_fill_((attention_mask == 0), 1).to(device)

        return final_embeddings, causal_mask, position_ids

    def forward(
        self,
        input_ids: torch.LongTensor,
        pixel_values: torch.FloatTensor,
        attention_mask: torch.Tensor,
        kv_cache: Optional[KVCache] = None,
    ) -> Tuple:
        # assert torch.all(attention_mask == 1), "The input cannot be padded"

        # Get Text embedding
        inputs_embeds = self.language_model.get_input_embeddings()(input_ids)

        # Get Image Embedding
        selected_image_feature = self.vision_tower(pixel_values.to(inputs_embeds.dtype))
        image_features = self.multi_modal_projector(selected_image_feature)

        # Concat together
        inputs_embeds, attention_mask, position_ids = self._merge_input_ids_with_image_features(
            image_features, inputs_embeds, input_ids, attention_mask, kv_cache
        )

        # Feed to Language Model
        outputs = self.language_model(
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            kv_cache=kv_cache,
        )

        return outputs

# ---- finetune_cord.py
def build_labels(
    input_ids: torch.Tensor,
    pad_token_id: int,
    image_token_id: Optional[int],
    bos_token_id: int = 2,
    newline_token_id: int = 108,
) -> torch.Tensor:
    labels = input_ids.clone()

    B, L = input_ids.shape
    for b in range(B):
        seq = input_ids[b]

        # find BOS
        bos_idx = (seq == bos_token_id).nonzero(as_tuple=True)[0]
        if len(bos_idx) == 0:
            prompt_end = 0
        else:
            bos_idx = bos_idx[0].item()

            # find first newline *after* BOS
            after_bos = seq[bos_idx + 1 :]
            nl_idx = (after_bos == newline_token_id).nonzero(as_tuple=True)[0]
            if len(nl_idx) > 0:
                prompt_end = bos_idx + 1 + nl_idx[0].item() + 1  # include newline
            else:
                prompt_end = bos_idx + 1

        labels[b, :prompt_end] = -100  # mask the prompt tokens
    # mask pads
    labels[labels == pad_token_id] = -100
    # mask image tokens if we can identify them
    if image_token_id is not None and image_token_id >= 0:
        labels[labels == image_token_id] = -100
    return labels


def train_step(
    model: nn.Module, batch: dict, pad_token_id: int, image_token_id: Optional[int], tokenizer, step
) -> torch.Tensor:
    input_ids = batch["input_ids"]  # [B, S]
    attention_mask = batch["attention_mask"]  # [B, S]
    pixel_values = batch["pixel_values"]  # [B, C, H, W]

    labels = build_labels(input_ids, pad_token_id, image_token_id)

    # Forward
    outputs = model(
        input_ids=input_ids,
        pixel_values=pixel_values,
        attention_mask=attention_mask,
        kv_cache=None,
    )
    logits = outputs["logits"]  # [B, S, V]

    shift_logits = logits[:, :-1, :].contiguous()
    shift_labels = labels[:, 1:].contiguous()
    loss = F.cross_entropy(
        shift_logits.view(-1, shift_logits.size(-1)),
        shift_labels.view(-1),
        ignore_index=-100,
    )
    return loss


def make_batch(config: ModelConfig):
    # "<image>" * n + "<bos>" + prompt + "\n" + target + "<eos>", padded on the right to the longest row
    image = [config.image_token_index] * config.vision_num_image_tokens
    prompt = [40, 41, 42]  # "extract JSON."
    targets = [[150, 151, 152, 153, 154, 155], [160, 161, 162]]
    rows = [image + [config.bos_token_id] + prompt + [108] + t + [config.eos_token_id] for t in targets]
    longest = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [config.pad_token_id] * (longest - len(r)) for r in rows])
    attention_mask = (torch.arange(longest)[None, :] < torch.tensor([len(r) for r in rows])[:, None]).long()
    pixel_values = torch.randn(len(rows), 3, config.vision_image_size, config.vision_image_size)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixel_values}


def main():
    torch.manual_seed(0)
    config = ModelConfig()
    model = PaliGemmaForConditionalGeneration(config)
    batch = make_batch(config)

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    for step in range(3):
        loss = train_step(model, batch, config.pad_token_id, config.image_token_index, None, step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
