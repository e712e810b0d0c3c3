# sgl-project/sglang#14364: the diffusion runtime's CLIP text encoder ran attention with causal=False and
# dropped the attention_mask it was given, so prompt tokens saw later tokens and the padding after EOS.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class CLIPTextArchConfig:
    vocab_size = 64
    hidden_size = 32
    intermediate_size = 64
    num_attention_heads = 4
    num_hidden_layers = 2
    max_position_embeddings = 16
    eos_token_id = 63
    pad_token_id = 0


class CLIPAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        b, s, _ = hidden_states.shape
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if FIXED:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        else:
            # LocalAttention(causal=False) does not take a mask
            out = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, -1))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = CLIPAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))
        self.layer_norm2 = nn.LayerNorm(config.hidden_size)

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = hidden_states + self.self_attn(self.layer_norm1(hidden_states), attention_mask)
        return hidden_states + self.mlp(self.layer_norm2(hidden_states))


def _create_4d_causal_attention_mask(input_shape, dtype):
    bsz, tgt_len = input_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, dtype=dtype).triu(1)
    return mask[None, None].expand(bsz, 1, tgt_len, tgt_len)


def _prepare_4d_attention_mask(mask, dtype):
    expanded = mask[:, None, None, :].to(dtype)
    return (1.0 - expanded) * torch.finfo(dtype).min


class CLIPTextTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList([CLIPEncoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.final_layer_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, input_ids, attention_mask=None):
        b, s = input_ids.shape
        pos = torch.arange(s)[None]
        hidden_states = self.token_embedding(input_ids) + self.position_embedding(pos)
        dtype = hidden_states.dtype
        causal_attention_mask = _create_4d_causal_attention_mask((b, s), dtype)
        if attention_mask is not None:
            attention_mask = _prepare_4d_attention_mask(attention_mask, dtype)
        mask = causal_attention_mask if attention_mask is None else causal_attention_mask + attention_mask
        mask = mask.clamp(min=torch.finfo(dtype).min)
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask)
        last_hidden_state = self.final_layer_norm(hidden_states)
        eos_pos = (input_ids == self.config.eos_token_id).int().argmax(dim=-1)
        pooled_output = last_hidden_state[torch.arange(b), eos_pos]
        return last_hidden_state, pooled_output


def main():
    torch.manual_seed(0)
    config = CLIPTextArchConfig()
    model = CLIPTextTransformer(config).eval()
    max_length = config.max_position_embeddings
    prompts = [[5, 9, 17, 23], [7, 11, 3, 40, 41, 42, 12, 8, 30]]
    input_ids = torch.full((len(prompts), max_length), config.pad_token_id)
    attention_mask = torch.zeros(len(prompts), max_length, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids = p + [config.eos_token_id]
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention_mask[i, :len(ids)] = 1
    with torch.no_grad():
        _, pooled = model(input_ids, attention_mask=attention_mask)
        # reference: the first prompt encoded alone, unpadded (causal CLIP text tower)
        ids0 = torch.tensor([prompts[0] + [config.eos_token_id]])
        h = model.token_embedding(ids0) + model.position_embedding(torch.arange(ids0.shape[1])[None])
        n = ids0.shape[1]
        for layer in model.layers:
            x = layer.layer_norm1(h)
            q, k, v = layer.self_attn.qkv_proj(x).chunk(3, dim=-1)
            q, k, v = (t.view(1, n, 4, 8).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + layer.self_attn.out_proj(a.transpose(1, 2).reshape(1, n, -1))
            h = h + layer.mlp(layer.layer_norm2(h))
        ref = model.final_layer_norm(h)[0, -1]
    print(f"fixed={FIXED} pooled EOS embedding max |diff| vs unpadded causal reference: "
          f"{(pooled[0] - ref).abs().max().item():.3e}")


if __name__ == "__main__":
    main()
