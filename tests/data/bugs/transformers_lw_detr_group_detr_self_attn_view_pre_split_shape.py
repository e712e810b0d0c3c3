# huggingface/transformers#44441 ("[LW-DETR] Fix training", merged; PR description read, pre-fix modular_lw_detr.py read).
# At training LwDetrAttention splits the num_queries * group_detr decoder queries into group_detr groups stacked on the
# batch axis, but viewed q/k/v with hidden_shape taken from the pre-split (batch, seq_len): the groups and the images of
# the batch were folded back into one sequence, so each query attended across groups and across images.
# Reduced: two decoder layers; the deformable cross-attention over image features is stood in by plain attention.
import sys
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class LwDetrConfig:
    d_model = 64
    decoder_self_attention_heads = 4
    decoder_cross_attention_heads = 4
    decoder_ffn_dim = 128
    decoder_layers = 2
    num_queries = 8
    group_detr = 3
    attention_bias = True
    attention_dropout = 0.0
    dropout = 0.0
    num_labels = 5
    _attn_implementation = "eager"


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


ALL_ATTENTION_FUNCTIONS = {"sdpa": None}


class LwDetrAttention(nn.Module):
    def __init__(self, config: LwDetrConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", config.d_model // config.decoder_self_attention_heads)
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False

        self.q_proj = nn.Linear(
            config.d_model, config.decoder_self_attention_heads * self.head_dim, bias=config.attention_bias
        )
        self.k_proj = nn.Linear(
            config.d_model, config.decoder_self_attention_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            config.d_model, config.decoder_self_attention_heads * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(
            config.decoder_self_attention_heads * self.head_dim, config.d_model, bias=config.attention_bias
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Optional[torch.Tensor] = None,
        **kwargs,
    ):
        batch_size, seq_len, _ = hidden_states.shape
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        hidden_states_original = hidden_states
        if position_embeddings is not None:
            hidden_states = hidden_states if position_embeddings is None else hidden_states + position_embeddings

        if self.training:
            # at training, we use group detr technique to add more supervision by using multiple weight-sharing decoders at once for faster convergence
            # at inference, we only use one decoder
            hidden_states_original = torch.cat(
                hidden_states_original.split(seq_len // self.config.group_detr, dim=1), dim=0
            )
            hidden_states = torch.cat(hidden_states.split(seq_len // self.config.group_detr, dim=1), dim=0)
            if FIXED:
                input_shape = hidden_states.shape[:-1]
                hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states_original).view(hidden_shape).transpose(1, 2)

        attention_interface: Callable = eager_attention_forward
        if self.config._attn_implementation != "eager":
            attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]

        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask=None,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)

        if self.training:
            attn_output = torch.cat(torch.split(attn_output, batch_size, dim=0), dim=1)

        return attn_output, attn_weights


class CrossAttention(nn.Module):
    """Stand-in for LwDetrMultiscaleDeformableAttention: queries attend to the flattened image features."""

    def __init__(self, config: LwDetrConfig):
        super().__init__()
        self.num_heads = config.decoder_cross_attention_heads
        self.head_dim = config.d_model // self.num_heads
        self.q_proj = nn.Linear(config.d_model, config.d_model)
        self.k_proj = nn.Linear(config.d_model, config.d_model)
        self.v_proj = nn.Linear(config.d_model, config.d_model)
        self.o_proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, hidden_states, position_embeddings, encoder_hidden_states):
        b, nq, d = hidden_states.shape
        q = self.q_proj(hidden_states + position_embeddings).view(b, nq, self.num_heads, -1).transpose(1, 2)
        k = self.k_proj(encoder_hidden_states).view(b, -1, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(encoder_hidden_states).view(b, -1, self.num_heads, self.head_dim).transpose(1, 2)
        out, _ = eager_attention_forward(self, q, k, v, None, self.head_dim**-0.5)
        return self.o_proj(out.reshape(b, nq, d)), None


class LwDetrMLP(nn.Module):
    def __init__(self, config: LwDetrConfig):
        super().__init__()
        self.dropout = config.dropout
        self.fc1 = nn.Linear(config.d_model, config.decoder_ffn_dim)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, config.d_model)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = F.relu(self.fc1(hidden_states))
        hidden_states = F.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = self.fc2(hidden_states)
        hidden_states = F.dropout(hidden_states, p=self.dropout, training=self.training)
        return residual + hidden_states


class LwDetrDecoderLayer(nn.Module):
    def __init__(self, config: LwDetrConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LwDetrAttention(config, layer_idx=layer_idx)
        self.dropout = config.dropout
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.cross_attn = CrossAttention(config)
        self.cross_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.mlp = LwDetrMLP(config)
        self.layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, hidden_states, position_embeddings=None, encoder_hidden_states=None):
        self_attention_output, self_attn_weights = self.self_attn(
            hidden_states, position_embeddings=position_embeddings
        )
        self_attention_output = F.dropout(self_attention_output, p=self.dropout, training=self.training)
        hidden_states = hidden_states + self_attention_output
        hidden_states = self.self_attn_layer_norm(hidden_states)

        cross_attention_output, _ = self.cross_attn(hidden_states, position_embeddings, encoder_hidden_states)
        hidden_states = self.cross_attn_layer_norm(hidden_states + cross_attention_output)

        hidden_states = self.mlp(hidden_states)
        return self.layer_norm(hidden_states)


class LwDetrDecoderModel(nn.Module):
    def __init__(self, config: LwDetrConfig):
        super().__init__()
        self.config = config
        self.group_detr = config.group_detr
        self.num_queries = config.num_queries
        self.query_feat = nn.Embedding(self.num_queries * self.group_detr, config.d_model)
        self.query_pos = nn.Embedding(self.num_queries * self.group_detr, config.d_model)
        self.input_proj = nn.Conv2d(3, config.d_model, kernel_size=8, stride=8)
        self.layers = nn.ModuleList([LwDetrDecoderLayer(config, i) for i in range(config.decoder_layers)])
        self.layernorm = nn.LayerNorm(config.d_model)
        self.class_embed = nn.Linear(config.d_model, config.num_labels)

    def forward(self, pixel_values):
        batch_size = pixel_values.shape[0]
        memory = self.input_proj(pixel_values).flatten(2).transpose(1, 2)
        num_queries = self.num_queries * self.group_detr if self.training else self.num_queries
        hidden_states = self.query_feat.weight[:num_queries].unsqueeze(0).expand(batch_size, -1, -1)
        query_pos = self.query_pos.weight[:num_queries].unsqueeze(0).expand(batch_size, -1, -1)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings=query_pos, encoder_hidden_states=memory)
        return self.class_embed(self.layernorm(hidden_states))


config = LwDetrConfig()
model = LwDetrDecoderModel(config)
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

pixel_values = torch.randn(2, 3, 32, 32)
labels = torch.randint(0, config.num_labels, (2, config.num_queries * config.group_detr))

logits = model(pixel_values)
loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
loss.backward()
optimizer.step()
print(f"loss {loss.item():.6f}")
