# Citation: google/gemma_pytorch @014acb7ac4563a5f77c76d7ff98f31b568c16508: gemma/gemma3_model.py
#   (Gemma3ForMultimodalLM.create_attention_mask: causal tril OR a bidirectional block per run of image placeholder
#   tokens, numbered by cumsum over the run starts; local_mask = that AND triu(diagonal=-(sliding_window_size-1));
#   both turned into additive 0 / finfo.min masks; generate(): right-padded prompts, prefill of min_prompt_len,
#   then one token a step with the longer prompts teacher-forced, mask rows index_select'ed at input_positions;
#   populate_image_embeddings), gemma/gemma3_preprocessor.py (tokenize_raw_input: BOS, "\n\n" BOI
#   <image placeholder> x encoding_sequence_length EOI "\n\n" per image, pad_id to max_prompt_len + output_len,
#   image_presence_mask for images padded with zeros), gemma/model.py (GemmaAttention over the preallocated
#   (B, max_seq_len, Hkv, D) cache, local_mask on LOCAL_SLIDING layers, qk norm, Gemma2DecoderLayer, GemmaModel,
#   Sampler) and gemma/config.py (Gemma 3: alternating LOCAL_SLIDING / GLOBAL, rope_wave_length per type).
# Tiny Gemma 3 (sliding_window_size = 5, four layers), float32, a word-level stand-in tokenizer and a trimmed
# SigLIP-like vision tower (patch embedding + average pooling to 4 soft tokens, no mask inside). A batch of two
# prompts: one image and a long question; two images and a short question, so the image batch is padded and
# the prompts right-padded. Checked against a per-sequence, cache-free recompute whose mask is a double loop
# (j <= i, or i and j in the same image's run of placeholders; and i - j < 5 on sliding layers): the final
# sequences' logits at every position, and generate()'s greedy tokens.
import dataclasses
import enum
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class AttentionType(enum.Enum):
    GLOBAL = 1
    LOCAL_SLIDING = 2


class Architecture(enum.Enum):
    GEMMA_1 = 1
    GEMMA_2 = 2
    GEMMA_3 = 3


@dataclasses.dataclass
class SiglipVisionModelConfig:
    input_channels: int = 3
    image_size: int = 16
    conv2d_patch_size: int = 4
    embedding_dim: int = 24
    # Number of soft tokens each image becomes after pooling.
    encoding_sequence_length: int = 4


@dataclasses.dataclass
class GemmaConfig:
    architecture: Architecture = Architecture.GEMMA_3
    vocab_size: int = 64
    max_position_embeddings: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    hidden_size: int = 32
    intermediate_size: int = 64
    head_dim: int = 8
    rms_norm_eps: float = 1e-6
    dtype: str = 'float32'
    quant: bool = False
    attn_types: Optional[Sequence[AttentionType]] = (AttentionType.LOCAL_SLIDING, AttentionType.GLOBAL)
    sliding_window_size: Optional[int] = 5
    final_logit_softcapping: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    query_pre_attn_scalar: Optional[int] = 8
    use_pre_ffw_norm: bool = True
    use_post_ffw_norm: bool = True
    rope_wave_length: Optional[dict] = dataclasses.field(default_factory=lambda: {
        AttentionType.LOCAL_SLIDING: 10_000,
        AttentionType.GLOBAL: 1_000_000,
    })
    use_qk_norm: bool = True
    vision_config: Optional[SiglipVisionModelConfig] = dataclasses.field(default_factory=SiglipVisionModelConfig)
    rope_scaling_factor: Optional[int] = 8

    def get_dtype(self):
        return torch.float32


class Tokenizer:
    """Word-level stand-in for the SentencePiece tokenizer, with Gemma 3's special ids."""

    def __init__(self, vocab_size):
        self.pad_id = 0
        self.eos_id = 1
        self.bos_id = 2
        self.boi_id = 3
        self.eoi_id = 4
        self.image_token_placeholder_id = 5
        self.vocab_size = vocab_size
        self._vocab = {"\n\n": 6}

    def encode(self, s, bos=True, eos=False):
        ids = []
        for word in (["\n\n"] if s == "\n\n" else s.split()):
            if word not in self._vocab:
                self._vocab[word] = 7 + len(self._vocab) - 1
            ids.append(self._vocab[word])
        if bos:
            ids = [self.bos_id] + ids
        if eos:
            ids = ids + [self.eos_id]
        return ids


def precompute_freqs_cis(dim, end, theta=10000.0, rope_scaling_factor=1):
    freqs = 1.0 / (theta**(torch.arange(0, dim, 2)[:(dim // 2)].float() / dim))
    freqs = freqs / rope_scaling_factor
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(x, freqs_cis):
    x_ = torch.view_as_complex(torch.stack(torch.chunk(x.transpose(1, 2).float(), 2, dim=-1), dim=-1))
    x_out = torch.view_as_real(x_ * freqs_cis).type_as(x)
    x_out = torch.cat(torch.chunk(x_out, 2, dim=-1), dim=-2)
    x_out = x_out.reshape(x_out.shape[0], x_out.shape[1], x_out.shape[2], -1).transpose(1, 2)
    return x_out


class Sampler(nn.Module):
    def __init__(self, vocab_size, config):
        super().__init__()
        self.vocab_size = vocab_size
        self.config = config

    @torch.no_grad()
    def forward(self, embedding, hidden_states, output_positions, temperatures, top_ps, top_ks):
        hidden_states = hidden_states.index_select(1, output_positions).squeeze(dim=1)
        logits = torch.matmul(hidden_states, embedding.t())
        if self.config.final_logit_softcapping is not None:
            logits = logits / self.config.final_logit_softcapping
            logits = torch.tanh(logits)
            logits = logits * self.config.final_logit_softcapping
        assert temperatures is None  # greedy only in this port
        return torch.argmax(logits, dim=-1).squeeze(dim=-1), logits


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, add_unit_offset=True):
        super().__init__()
        self.eps = eps
        self.add_unit_offset = add_unit_offset
        self.weight = nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, x):
        output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        output = output * (1 + self.weight.float()) if self.add_unit_offset else output * self.weight.float()
        return output.type_as(x)


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaAttention(nn.Module):
    def __init__(self, config: GemmaConfig, attn_type: AttentionType):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = (config.query_pre_attn_scalar or self.head_dim)**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                                  bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.query_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.use_qk_norm else None
        self.key_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.use_qk_norm else None
        self.attn_type = attn_type
        self.sliding_window_size = config.sliding_window_size
        self.attn_logit_softcapping = config.attn_logit_softcapping

    def forward(self, hidden_states, freqs_cis, kv_write_indices, kv_cache, mask, local_mask=None):
        batch_size, input_len, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        xq, xk, xv = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        xq = xq.view(batch_size, -1, self.num_heads, self.head_dim)
        xk = xk.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xv = xv.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        if self.query_norm is not None and self.key_norm is not None:
            xq = self.query_norm(xq)
            xk = self.key_norm(xk)
        xq = apply_rotary_emb(xq, freqs_cis=freqs_cis)
        xk = apply_rotary_emb(xk, freqs_cis=freqs_cis)

        # Write new kv cache.
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(1, kv_write_indices, xk)
        v_cache.index_copy_(1, kv_write_indices, xv)

        key, value = k_cache, v_cache
        if self.num_kv_heads != self.num_heads:
            key = torch.repeat_interleave(key, self.num_queries_per_kv, dim=2)
            value = torch.repeat_interleave(value, self.num_queries_per_kv, dim=2)
        q = xq.transpose(1, 2)
        k = key.transpose(1, 2)
        v = value.transpose(1, 2)

        # [batch_size, n_local_heads, input_len, max_seq_len]
        q.mul_(self.scaling)
        scores = torch.matmul(q, k.transpose(2, 3))
        if (self.attn_type == AttentionType.LOCAL_SLIDING and self.sliding_window_size is not None
                and local_mask is not None):
            mask = local_mask
        if self.attn_logit_softcapping is not None:
            scores = scores / self.attn_logit_softcapping
            scores = torch.tanh(scores)
            scores = scores * self.attn_logit_softcapping
        scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(q)
        output = torch.matmul(scores, v)
        output = output.transpose(1, 2).contiguous().view(batch_size, input_len, -1)
        return self.o_proj(output)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config, attn_type):
        super().__init__()
        self.attn_type = attn_type
        self.self_attn = GemmaAttention(config=config, attn_type=attn_type)
        self.mlp = GemmaMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, freqs_cis, kv_write_indices, kv_cache, mask, local_mask):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states=hidden_states, freqs_cis=freqs_cis,
                                       kv_write_indices=kv_write_indices, kv_cache=kv_cache, mask=mask,
                                       local_mask=local_mask)
        hidden_states = residual + self.post_attention_layernorm(hidden_states)
        residual = hidden_states
        hidden_states = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden_states)))
        return residual + hidden_states


class GemmaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList()
        for i in range(config.num_hidden_layers):
            attn_type = (config.attn_types[i % len(config.attn_types)]
                         if config.attn_types is not None else AttentionType.GLOBAL)
            self.layers.append(Gemma2DecoderLayer(config, attn_type))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, freqs_cis, kv_write_indices, kv_caches, mask, local_mask):
        for i in range(len(self.layers)):
            layer = self.layers[i]
            hidden_states = layer(hidden_states=hidden_states, freqs_cis=freqs_cis.get(layer.attn_type),
                                  kv_write_indices=kv_write_indices, kv_cache=kv_caches[i], mask=mask,
                                  local_mask=local_mask)
        return self.norm(hidden_states)


class SiglipVisionModel(nn.Module):
    """Trimmed SigLIP tower: patch embedding, position embedding, norm, average pooling to the soft tokens."""

    def __init__(self, config: SiglipVisionModelConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(config.input_channels, config.embedding_dim,
                                         kernel_size=config.conv2d_patch_size, stride=config.conv2d_patch_size)
        num_patches = (config.image_size // config.conv2d_patch_size)**2
        self.position_embedding = nn.Embedding(num_patches, config.embedding_dim)
        self.register_buffer("position_ids", torch.arange(num_patches).unsqueeze(0), persistent=False)
        self.encoder_norm = nn.LayerNorm(config.embedding_dim)
        side = config.image_size // config.conv2d_patch_size
        tokens_side = int(config.encoding_sequence_length**0.5)
        self.avg_pool = nn.AvgPool2d(kernel_size=side // tokens_side, stride=side // tokens_side)
        self.side = side

    def forward(self, pixel_values):
        x = self.patch_embedding(pixel_values)  # B x D x h x w
        x = x.flatten(2).transpose(1, 2) + self.position_embedding(self.position_ids)
        x = self.encoder_norm(x)
        b, n, d = x.shape
        x = x.transpose(1, 2).reshape(b, d, self.side, self.side)
        x = self.avg_pool(x)
        return x.flatten(2).transpose(1, 2)  # B x U x D


class Gemma3ForMultimodalLM(nn.Module):
    """Gemma3 model for multimodal causal LM."""

    def __init__(self, config: GemmaConfig):
        super().__init__()
        self.dtype = config.get_dtype()
        assert config.architecture == Architecture.GEMMA_3
        self.config = config
        max_seq_len = config.max_position_embeddings
        head_dim = config.head_dim
        vocab_size = config.vocab_size
        self.tokenizer = Tokenizer(vocab_size)
        self.text_token_embedder = nn.Embedding(vocab_size, config.hidden_size)
        nn.init.normal_(self.text_token_embedder.weight, std=0.1)
        self.model = GemmaModel(config)
        self.sampler = Sampler(vocab_size, config)

        self.siglip_vision_model = SiglipVisionModel(config.vision_config)
        # transformer/embedder/mm_soft_embedding_norm
        self.mm_soft_embedding_norm = RMSNorm(config.vision_config.embedding_dim, eps=config.rms_norm_eps)
        # transformer/embedder/mm_input_projection
        self.mm_input_projection = nn.Linear(config.vision_config.embedding_dim, config.hidden_size, bias=False)

        rope_lengths = config.rope_wave_length
        self._register_freqs_cis('local_freqs_cis', head_dim, max_seq_len,
                                 theta=rope_lengths.get(AttentionType.LOCAL_SLIDING, 10_000))
        self._register_freqs_cis('global_freqs_cis', head_dim, max_seq_len,
                                 theta=rope_lengths.get(AttentionType.GLOBAL, 10_000),
                                 rope_scaling_factor=config.rope_scaling_factor)

    def _register_freqs_cis(self, name, head_dim, max_seq_len, theta=10_000, rope_scaling_factor=1):
        self.register_buffer(name, precompute_freqs_cis(head_dim, max_seq_len * 2, theta=theta,
                                                        rope_scaling_factor=rope_scaling_factor))

    @torch.no_grad()
    def forward(self, input_token_ids, image_patches, image_presence_mask, input_positions, kv_caches, mask,
                output_positions, temperatures, top_ps, top_ks, local_mask=None, **kwargs):
        freqs_cis = {}
        freqs_cis[AttentionType.LOCAL_SLIDING] = self.local_freqs_cis.index_select(0, input_positions)
        freqs_cis[AttentionType.GLOBAL] = self.global_freqs_cis.index_select(0, input_positions)
        hidden_states = self.text_token_embedder(input_token_ids)
        normalizer = torch.tensor(self.config.hidden_size**0.5, dtype=hidden_states.dtype)
        hidden_states = hidden_states * normalizer
        if image_patches is not None and self.config.vision_config is not None:
            # the input has images
            B, N, C, H, W = image_patches.shape
            flattened_input = image_patches.reshape(B * N, C, H, W)  # (B*N)xCxHxW
            image_embeddings = self.siglip_vision_model(flattened_input)  # (B*N)xUxD
            image_embeddings = self.mm_soft_embedding_norm(image_embeddings)
            image_embeddings = self.mm_input_projection(image_embeddings)  # (B*N) x U x model_dim
            hidden_states = self.populate_image_embeddings(hidden_states.clone(), image_embeddings.clone(),
                                                           input_token_ids.clone(), image_presence_mask.clone())

        kv_write_indices = input_positions
        hidden_states = self.model(hidden_states=hidden_states, freqs_cis=freqs_cis,
                                   kv_write_indices=kv_write_indices, kv_caches=kv_caches, mask=mask,
                                   local_mask=local_mask)
        embedder_weight = self.text_token_embedder.weight
        next_tokens, logits = self.sampler(embedding=embedder_weight, hidden_states=hidden_states,
                                           output_positions=output_positions, temperatures=temperatures,
                                           top_ps=top_ps, top_ks=top_ks)
        return next_tokens, logits

    def populate_image_embeddings(self, hidden_states, image_embeddings, input_token_ids, image_presence_mask):
        batch_size, seq_len, model_dim = hidden_states.shape
        # Step 1 of 2: Fetch valid image embeddings
        valid_image_embeddings_indices = torch.nonzero(image_presence_mask.flatten(), as_tuple=False).squeeze()
        valid_image_embeddings = image_embeddings.index_select(0, valid_image_embeddings_indices)
        # Step 2 of 2: Replace image embeddings at right places.
        image_placeholder_mask = input_token_ids == self.tokenizer.image_token_placeholder_id
        image_placeholder_indices = image_placeholder_mask.flatten().nonzero(as_tuple=False).squeeze()
        hidden_states = hidden_states.reshape(-1, self.config.hidden_size)
        hidden_states[image_placeholder_indices] = valid_image_embeddings.reshape(-1, self.config.hidden_size)
        return hidden_states.reshape(batch_size, seq_len, model_dim).contiguous()

    def create_attention_mask(self, input_ids: torch.Tensor, sequence_length: int):
        batch_size = input_ids.shape[0]
        causal_mask = torch.tril(torch.ones((batch_size, 1, sequence_length, sequence_length), dtype=torch.bool,
                                            device=input_ids.device))
        image_token_mask = input_ids == self.tokenizer.image_token_placeholder_id
        # Pad the mask to the left with 0. This is to make sure the boundary
        # detection works correctly. Boundary (starting index of image patch) is
        # detected when the value changes from 0 to 1.
        padded_mask = nn.functional.pad(image_token_mask, (1, 0), value=0)
        # Find the boundary (starting index) of the image tokens patch.
        boundary = padded_mask[:, 1:] > padded_mask[:, :-1]
        # Number the boundary.
        numbered_boundary = torch.cumsum(boundary, dim=-1)
        q_block_indices = image_token_mask * numbered_boundary
        kv_block_indices = q_block_indices
        # Test the equality of vertical and horizontal numbered patches
        # to create the bidirectional mask.
        bidirectional_mask = torch.logical_and(
            kv_block_indices[:, None, :] == q_block_indices.unsqueeze(-1),
            q_block_indices.unsqueeze(-1) > 0,
        )
        attention_mask = torch.logical_or(causal_mask, bidirectional_mask.unsqueeze(1))
        # The upper triangular matrix's diagonal is shifted by sliding window size
        # before doing logical 'and' with attention mask. This is to make sure the
        # local attention is within the sliding window.
        local_mask = torch.logical_and(
            attention_mask,
            torch.triu(torch.ones((1, 1, sequence_length, sequence_length), dtype=torch.bool,
                                  device=input_ids.device), diagonal=-(self.config.sliding_window_size - 1)))
        return attention_mask, local_mask

    def generate(self, prompts, device: Any, output_len: int = 100, temperature: Union[float, None] = 1.0,
                 top_p: float = 0.95, top_k: int = 64):
        """Generates token ids for the given prompts (detokenization left out of this port)."""
        processing_result = tokenize_raw_input(self.tokenizer, prompts, self.config, output_len, device)
        batch_size = processing_result["batch_size"]
        user_input_token_ids = processing_result["user_input_token_ids"]
        image_batch = processing_result["image_batch"]
        min_prompt_len = processing_result["min_prompt_len"]
        total_seq_len = processing_result["max_seq_len"]
        image_presence_mask = processing_result["image_presence_mask"]

        # Create attention mask.
        min_dtype = torch.finfo(self.dtype).min
        if self.config.sliding_window_size is None:
            raise ValueError('gemma 3 model requires sliding_window size')
        boolean_mask, local_boolean_mask = self.create_attention_mask(user_input_token_ids, total_seq_len)
        mask_tensor = torch.where(boolean_mask, 0, torch.tensor(min_dtype, dtype=torch.float32,
                                                                device=device)).contiguous()
        local_mask_tensor = torch.where(local_boolean_mask, 0, torch.tensor(min_dtype, dtype=torch.float32,
                                                                            device=device)).contiguous()

        kv_caches = []
        for _ in range(self.config.num_hidden_layers):
            size = (batch_size, total_seq_len, self.config.num_key_value_heads, self.config.head_dim)
            dtype = self.config.get_dtype()
            k_cache = torch.zeros(size=size, dtype=dtype, device=device)
            v_cache = torch.zeros(size=size, dtype=dtype, device=device)
            kv_caches.append((k_cache, v_cache))

        input_token_ids_tensor = torch.full((batch_size, min_prompt_len), self.tokenizer.pad_id, dtype=torch.int64,
                                            device=device)
        token_ids_tensor = user_input_token_ids.to(device)
        for i in range(batch_size):
            p = user_input_token_ids[i]
            input_token_ids_tensor[i, :min_prompt_len] = p[:min_prompt_len]

        input_positions_tensor = torch.arange(0, min_prompt_len, dtype=torch.int64, device=device)
        prompt_mask_tensor = token_ids_tensor != self.tokenizer.pad_id
        curr_mask_tensor = mask_tensor.index_select(2, input_positions_tensor)
        curr_local_mask_tensor = local_mask_tensor.index_select(2, input_positions_tensor)
        output_positions_tensor = torch.LongTensor([min_prompt_len - 1]).to(device)
        temperatures_tensor = None if not temperature else torch.FloatTensor([temperature] * batch_size).to(device)
        top_ps_tensor = torch.FloatTensor([top_p] * batch_size).to(device)
        top_ks_tensor = torch.LongTensor([top_k] * batch_size).to(device)
        output_index = torch.tensor(min_prompt_len, dtype=torch.int64, device=device)

        # Prefill up to min_prompt_len tokens, then treat other prefill as
        # decode and ignore output.
        for i in range(total_seq_len - min_prompt_len):
            next_token_ids, _ = self(input_token_ids=input_token_ids_tensor, image_patches=image_batch,
                                     image_presence_mask=image_presence_mask,
                                     input_positions=input_positions_tensor, kv_caches=kv_caches,
                                     mask=curr_mask_tensor, output_positions=output_positions_tensor,
                                     temperatures=temperatures_tensor, top_ps=top_ps_tensor, top_ks=top_ks_tensor,
                                     local_mask=curr_local_mask_tensor)
            curr_prompt_mask = prompt_mask_tensor.index_select(1, output_index).squeeze(dim=1)
            curr_token_ids = token_ids_tensor.index_select(1, output_index).squeeze(dim=1)
            output_token_ids = torch.where(curr_prompt_mask, curr_token_ids, next_token_ids).unsqueeze(dim=1)
            token_ids_tensor.index_copy_(1, output_index, output_token_ids)

            input_token_ids_tensor = output_token_ids
            input_positions_tensor = output_index.unsqueeze(dim=-1)
            curr_mask_tensor = mask_tensor.index_select(2, input_positions_tensor)
            curr_local_mask_tensor = local_mask_tensor.index_select(
                2, input_positions_tensor) if local_mask_tensor is not None else None
            output_positions_tensor = torch.tensor(0, dtype=torch.int64, device=device)
            output_index = output_index + 1
            image_batch = None
            image_presence_mask = None

        return token_ids_tensor, processing_result


def tokenize_raw_input(tokenizer_obj: Tokenizer, raw_input, config: GemmaConfig, output_len: int, device):
    """Interleaved text and (already preprocessed) images -> right-padded token ids and a padded image batch."""
    all_token_ids, all_images, prompt_lengths = [], [], []
    max_prompt_len, min_prompt_len, max_num_images = 0, float("inf"), 0
    for prompt in raw_input:
        token_ids, images = [tokenizer_obj.bos_id], []
        for element in prompt:
            if isinstance(element, str):
                token_ids.extend(tokenizer_obj.encode(element, bos=False, eos=False))
            elif isinstance(element, torch.Tensor):
                # Prepend (dual endline + tokenizer_obj.boi)
                token_ids.extend(tokenizer_obj.encode("\n\n", bos=False, eos=False))
                token_ids.append(tokenizer_obj.boi_id)
                # Add image placeholder tokens
                token_ids.extend([tokenizer_obj.image_token_placeholder_id]
                                 * config.vision_config.encoding_sequence_length)
                # Append (tokenizer_obj.eoi + dual endline)
                token_ids.append(tokenizer_obj.eoi_id)
                token_ids.extend(tokenizer_obj.encode("\n\n", bos=False, eos=False))
                images.append(element)
            else:
                raise ValueError("Unsupported type in prompt. Expected str or torch.Tensor.")
        curr_prompt_len = len(token_ids)
        prompt_lengths.append(curr_prompt_len)
        max_prompt_len = max(max_prompt_len, curr_prompt_len)
        min_prompt_len = min(min_prompt_len, curr_prompt_len)
        max_num_images = max(max_num_images, len(images))
        all_token_ids.append(token_ids)
        all_images.append(images)

    max_seq_len = max_prompt_len + output_len

    # Pad token IDs to the maximum sequence length
    user_input_token_ids = []
    for token_ids in all_token_ids:
        pad_length = max_seq_len - len(token_ids)
        user_input_token_ids.append(token_ids + [tokenizer_obj.pad_id] * pad_length)

    # Pad images to the maximum number of images in the batch
    image_batch, image_presence_mask = [], []
    for images in all_images:
        pad_length = max_num_images - len(images)
        padded_images = images.copy()
        presence_mask = [True] * len(images)
        if pad_length > 0:
            padded_images.extend([torch.zeros((config.vision_config.input_channels, config.vision_config.image_size,
                                               config.vision_config.image_size), device=device)
                                  for _ in range(pad_length)])
            presence_mask.extend([False] * pad_length)
        image_batch.append(padded_images)
        image_presence_mask.append(presence_mask)

    user_input_token_ids = torch.tensor(user_input_token_ids, dtype=torch.long, device=device)
    if max_num_images > 0:
        image_batch = torch.stack([torch.stack(images) for images in image_batch]).to(device)
        image_presence_mask = torch.tensor(image_presence_mask, dtype=torch.bool, device=device)
    else:
        image_batch = None
        image_presence_mask = None
    return {
        "user_input_token_ids": user_input_token_ids,
        "image_batch": image_batch,
        "batch_size": len(raw_input),
        "min_prompt_len": min_prompt_len,
        "max_prompt_len": max_prompt_len,
        "max_seq_len": max_seq_len,
        "image_presence_mask": image_presence_mask,
        "prompt_lengths": prompt_lengths,
    }


# ---------------------------------------------------------------- reference: one sequence, no cache, loop mask

def reference_logits(model: Gemma3ForMultimodalLM, token_ids: List[int], prompt_len: int, images: List[torch.Tensor]):
    """Logits at every position of one sequence, alone, through a fresh full-length cache, with a double-loop mask.

    Images are the prompt's: a generated token that happens to be the placeholder id stays a text token."""
    cfg = model.config
    L = len(token_ids)
    ids = torch.tensor([token_ids])
    img_id = model.tokenizer.image_token_placeholder_id
    # Which image's run of placeholders each position belongs to (-1: text).
    run_of, run = [], -1
    for t in range(L):
        if t < prompt_len and token_ids[t] == img_id:
            if t == 0 or token_ids[t - 1] != img_id:
                run += 1
            run_of.append(run)
        else:
            run_of.append(-1)
    full = torch.full((1, 1, L, L), torch.finfo(torch.float32).min)
    local = full.clone()
    for i in range(L):
        for j in range(L):
            seen = j <= i or (run_of[i] >= 0 and run_of[i] == run_of[j])
            if seen:
                full[0, 0, i, j] = 0.0
                if i - j < cfg.sliding_window_size:
                    local[0, 0, i, j] = 0.0
    positions = torch.arange(L)
    freqs_cis = {AttentionType.LOCAL_SLIDING: model.local_freqs_cis.index_select(0, positions),
                 AttentionType.GLOBAL: model.global_freqs_cis.index_select(0, positions)}
    h = model.text_token_embedder(ids) * torch.tensor(cfg.hidden_size**0.5)
    if images:
        emb = model.mm_input_projection(model.mm_soft_embedding_norm(model.siglip_vision_model(torch.stack(images))))
        h = h.clone()
        is_image = (ids[0] == img_id) & (torch.arange(L) < prompt_len)
        h[0, is_image] = emb.reshape(-1, cfg.hidden_size)
    kv_caches = [(torch.zeros(1, L, cfg.num_key_value_heads, cfg.head_dim),
                  torch.zeros(1, L, cfg.num_key_value_heads, cfg.head_dim)) for _ in range(cfg.num_hidden_layers)]
    h = model.model(hidden_states=h, freqs_cis=freqs_cis, kv_write_indices=positions, kv_caches=kv_caches,
                    mask=full, local_mask=local)
    return h[0] @ model.text_token_embedder.weight.t()


def main():
    config = GemmaConfig()
    model = Gemma3ForMultimodalLM(config).eval()
    vc = config.vision_config
    image_a = torch.randn(vc.input_channels, vc.image_size, vc.image_size)
    image_b = torch.randn(vc.input_channels, vc.image_size, vc.image_size)
    image_c = torch.randn(vc.input_channels, vc.image_size, vc.image_size)
    prompts = [
        [image_a, "what is shown in this picture and where was it taken"],
        [image_b, image_c, "compare"],
    ]
    output_len = 6
    with torch.no_grad():
        token_ids, info = model.generate(prompts, device="cpu", output_len=output_len, temperature=None)
        total = info["max_seq_len"]
        prompt_lengths = info["prompt_lengths"]
        print("prompt lengths", prompt_lengths, "min_prompt_len", info["min_prompt_len"], "total", total)
        assert min(prompt_lengths) < max(prompt_lengths) and total > config.sliding_window_size * 3

        # The batch's final sequences through the model's own masks, every position at once.
        # generate() builds its masks from the right-padded prompts before decoding (its token_ids_tensor is that
        # same tensor, filled in place as it goes), so tokenize them again for the masks here.
        prompt_ids = tokenize_raw_input(model.tokenizer, prompts, config, output_len, "cpu")["user_input_token_ids"]
        assert (prompt_ids != model.tokenizer.pad_id).sum(-1).tolist() == prompt_lengths
        boolean_mask, local_boolean_mask = model.create_attention_mask(prompt_ids, total)
        min_dtype = torch.finfo(torch.float32).min
        mask = torch.where(boolean_mask, 0, torch.tensor(min_dtype))
        local_mask = torch.where(local_boolean_mask, 0, torch.tensor(min_dtype))
        positions = torch.arange(total)
        freqs_cis = {AttentionType.LOCAL_SLIDING: model.local_freqs_cis.index_select(0, positions),
                     AttentionType.GLOBAL: model.global_freqs_cis.index_select(0, positions)}
        h = model.text_token_embedder(token_ids) * torch.tensor(config.hidden_size**0.5)
        h = model.populate_image_embeddings(h.clone(), model.mm_input_projection(model.mm_soft_embedding_norm(
            model.siglip_vision_model(info["image_batch"].reshape(-1, vc.input_channels, vc.image_size,
                                                                  vc.image_size)))),
            prompt_ids, info["image_presence_mask"])
        kv_caches = [(torch.zeros(2, total, config.num_key_value_heads, config.head_dim),
                      torch.zeros(2, total, config.num_key_value_heads, config.head_dim))
                     for _ in range(config.num_hidden_layers)]
        h = model.model(hidden_states=h, freqs_cis=freqs_cis, kv_write_indices=positions, kv_caches=kv_caches,
                        mask=mask, local_mask=local_mask)
        batched_logits = h @ model.text_token_embedder.weight.t()

        images_per_row = [[image_a], [image_b, image_c]]
        for b in range(2):
            row = token_ids[b].tolist()
            assert model.tokenizer.pad_id not in row
            ref = reference_logits(model, row, prompt_lengths[b], images_per_row[b])
            err = (batched_logits[b] - ref).abs().max().item()
            print(f"row {b}: max |batched - reference| logits = {err:.2e}")
            assert err < 1e-4, err
            # generate()'s greedy tokens equal the reference's, token by token (each from the prefix before it).
            for p in range(prompt_lengths[b], total):
                ref_p = reference_logits(model, row[:p], prompt_lengths[b], images_per_row[b])
                assert ref_p[-1].argmax().item() == row[p], (b, p)
                assert torch.allclose(ref_p, ref[:p], atol=1e-4)
            print(f"row {b}: generated", row[prompt_lengths[b]:])
    print("ok")


if __name__ == "__main__":
    main()
