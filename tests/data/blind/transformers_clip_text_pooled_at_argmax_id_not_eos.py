# Citation: huggingface/transformers#24777 ("Make CLIP model could use new added tokens with meaningful
#   pooling", fixes #24650 / #21029; default bos/eos ids corrected in #24773).
# Upstream: src/transformers/models/clip/modeling_clip.py -- CLIPTextTransformer.__init__/forward
#   (_make_causal_mask / _build_causal_attention_mask, _expand_mask, CLIPEncoder, pooled_output),
#   CLIPAttention.forward (causal_attention_mask + attention_mask added to the scores). Ported to plain
#   torch as it stood in mid-2023, shrunk to tiny sizes with random weights.
# Bug: the causal text tower reads its pooled (EOS) feature at input_ids.argmax(-1), assuming the EOS
#   token has the highest id in the vocabulary. After textual inversion adds a token (id above EOS),
#   the pooled feature is read at the new token instead, whose causal row cannot see the rest of the
#   prompt; text_embeds then depend on a prefix only.
# Fix: store config.eos_token_id and, unless it is the legacy value 2, pool at the first position where
#   input_ids == eos_token_id: (input_ids == self.eos_token_id).int().argmax(dim=-1).
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class CLIPTextConfig:
    vocab_size: int = 40
    hidden_size: int = 32
    intermediate_size: int = 64
    projection_dim: int = 16
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    max_position_embeddings: int = 16
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 39
    bos_token_id: int = 38
    eos_token_id: int = 39


def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask, dtype, tgt_len=None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


class CLIPTextEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.register_buffer("position_ids",
                             torch.arange(config.max_position_embeddings).expand((1, -1)))

    def forward(self, input_ids):
        seq_length = input_ids.shape[-1]
        position_ids = self.position_ids[:, :seq_length]
        return self.token_embedding(input_ids) + self.position_embedding(position_ids)


class CLIPAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.scale = self.head_dim ** -0.5
        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask=None, causal_attention_mask=None):
        bsz, tgt_len, embed_dim = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scale
        key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
        value_states = self._shape(self.v_proj(hidden_states), -1, bsz)

        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)

        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))

        if causal_attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + causal_attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, tgt_len, embed_dim)
        return self.out_proj(attn_output)


class CLIPMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states):
        h = self.fc1(hidden_states)
        h = h * torch.sigmoid(1.702 * h)  # quick_gelu
        return self.fc2(h)


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = CLIPAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask, causal_attention_mask):
        residual = hidden_states
        hidden_states = self.layer_norm1(hidden_states)
        hidden_states = self.self_attn(hidden_states, attention_mask, causal_attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.layer_norm2(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class CLIPEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([CLIPEncoderLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, inputs_embeds, attention_mask=None, causal_attention_mask=None):
        hidden_states = inputs_embeds
        for encoder_layer in self.layers:
            hidden_states = encoder_layer(hidden_states, attention_mask, causal_attention_mask)
        return hidden_states


class CLIPTextTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = CLIPTextEmbeddings(config)
        self.encoder = CLIPEncoder(config)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if FIXED:
            # For `pooled_output` computation
            self.eos_token_id = config.eos_token_id

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        input_shape = input_ids.size()
        input_ids = input_ids.view(-1, input_shape[-1])
        hidden_states = self.embeddings(input_ids=input_ids)

        # CLIP's text model uses causal mask, prepare it here.
        causal_attention_mask = _make_causal_mask(input_shape, hidden_states.dtype,
                                                  device=hidden_states.device)
        # expand attention_mask
        if attention_mask is not None:
            attention_mask = _expand_mask(attention_mask, hidden_states.dtype)

        last_hidden_state = self.encoder(inputs_embeds=hidden_states, attention_mask=attention_mask,
                                         causal_attention_mask=causal_attention_mask)
        last_hidden_state = self.final_layer_norm(last_hidden_state)

        if not FIXED or self.eos_token_id == 2:
            # text_embeds.shape = [batch_size, sequence_length, transformer.width]
            # take features from the eot embedding (eot_token is the highest number in each sequence)
            # casting to torch.int for onnx compatibility: argmax doesn't support int64 inputs with opset 14
            pooled_output = last_hidden_state[
                torch.arange(last_hidden_state.shape[0], device=last_hidden_state.device),
                input_ids.to(dtype=torch.int, device=last_hidden_state.device).argmax(dim=-1),
            ]
        else:
            # The config gets updated `eos_token_id` from PR #24773 (so the use of exta new tokens is possible)
            pooled_output = last_hidden_state[
                torch.arange(last_hidden_state.shape[0], device=last_hidden_state.device),
                # We need to get the first position of `eos_token_id` value (`pad_token_ids` might equal to `eos_token_id`)
                (input_ids.to(dtype=torch.int, device=last_hidden_state.device) == self.eos_token_id)
                .int()
                .argmax(dim=-1),
            ]
        return last_hidden_state, pooled_output


class CLIPTextModelWithProjection(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.text_model = CLIPTextTransformer(config)
        self.text_projection = nn.Linear(config.hidden_size, config.projection_dim, bias=False)

    def forward(self, input_ids, attention_mask=None):
        _, pooled_output = self.text_model(input_ids=input_ids, attention_mask=attention_mask)
        return self.text_projection(pooled_output)


if __name__ == "__main__":
    config = CLIPTextConfig()
    model = CLIPTextModelWithProjection(config).eval()

    # Textual inversion: one placeholder token "<cat-toy>" added to the tokenizer and the embedding
    # resized (model.resize_token_embeddings), so its id (40) is above <|endoftext|> (39).
    old = model.text_model.embeddings.token_embedding
    new = nn.Embedding(config.vocab_size + 1, config.hidden_size)
    with torch.no_grad():
        new.weight[:config.vocab_size] = old.weight
    model.text_model.embeddings.token_embedding = new
    placeholder_id = config.vocab_size
    config.vocab_size += 1

    bos, eos, L = config.bos_token_id, config.eos_token_id, 12
    # "a photo of <cat-toy> on a beach", "a <cat-toy> sitting", "a photo of a dog"; padded
    # to max_length with <|endoftext|> (the CLIP tokenizer's pad token) as SD pipelines do.
    prompts = [[3, 7, 11, placeholder_id, 15, 3, 21],
               [3, placeholder_id, 25],
               [3, 7, 11, 3, 30]]
    input_ids = torch.full((len(prompts), L), config.pad_token_id)
    attention_mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids = [bos] + p + [eos]
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention_mask[i, :len(ids)] = 1

    with torch.no_grad():
        text_embeds = model(input_ids, attention_mask=attention_mask)
    text_embeds = text_embeds / text_embeds.norm(dim=-1, keepdim=True)
    print("mode:", "fixed" if FIXED else "buggy")
    for i in range(len(prompts)):
        print(f"prompt {i}: text_embeds[:4] = {[round(v, 4) for v in text_embeds[i, :4].tolist()]}")
    sim = text_embeds @ text_embeds.t()
    print("similarity(0,1) =", round(float(sim[0, 1]), 4), " similarity(0,2) =", round(float(sim[0, 2]), 4))
