# huggingface/transformers#35922: Moonshine ignored the audio attention_mask, so in batched transcription the
# encoder self-attention and the decoder cross-attention attended to the zero-padded frames of shorter clips.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class MoonshineConfig:
    vocab_size = 48
    hidden_size = 32
    num_attention_heads = 4
    encoder_num_hidden_layers = 2
    decoder_num_hidden_layers = 2
    decoder_start_token_id = 1


class MoonshineAttention(nn.Module):
    def __init__(self, config, is_causal):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.is_causal = is_causal
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, key_value_states=None, attention_mask=None, past_key_value=None):
        b, q_len, _ = hidden_states.shape
        kv_in = hidden_states if key_value_states is None else key_value_states

        def split(x):
            return x.view(b, -1, self.num_heads, self.head_dim).transpose(1, 2)

        query_states = split(self.q_proj(hidden_states))
        key_states, value_states = split(self.k_proj(kv_in)), split(self.v_proj(kv_in))
        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        is_causal = self.is_causal and attention_mask is None and q_len > 1
        attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states,
                                                     attn_mask=attention_mask, is_causal=is_causal)
        attn_output = attn_output.transpose(1, 2).reshape(b, q_len, -1)
        return self.o_proj(attn_output), (key_states, value_states)


class MoonshineEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.conv1 = nn.Conv1d(1, d, kernel_size=127, stride=64, bias=False)
        self.groupnorm = nn.GroupNorm(num_groups=1, num_channels=d)
        self.conv2 = nn.Conv1d(d, 2 * d, kernel_size=7, stride=3)
        self.conv3 = nn.Conv1d(2 * d, d, kernel_size=3, stride=2)
        self.layers = nn.ModuleList([MoonshineAttention(config, is_causal=False)
                                     for _ in range(config.encoder_num_hidden_layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(d) for _ in range(config.encoder_num_hidden_layers)])

    def forward(self, input_values, attention_mask=None):
        x = self.groupnorm(torch.tanh(self.conv1(input_values.unsqueeze(1))))
        x = F.gelu(self.conv2(x))
        x = F.gelu(self.conv3(x)).permute(0, 2, 1)
        if FIXED and attention_mask is not None:
            # attention mask downsampling (conv strides 64 * 3 * 2)
            mask_len = x.shape[-2]
            downsample_stride = 64 * 3 * 2
            attention_mask = attention_mask[..., ::downsample_stride][..., :mask_len]
            attention_mask = attention_mask.reshape((attention_mask.shape[0], 1, 1, -1)).to(torch.bool)
        else:
            attention_mask = None
        for layer, norm in zip(self.layers, self.norms):
            x = x + layer(norm(x), attention_mask=attention_mask)[0]
        return x, attention_mask


class MoonshineDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.self_attn = MoonshineAttention(config, is_causal=True)
        self.encoder_attn = MoonshineAttention(config, is_causal=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d))
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x, encoder_hidden_states, encoder_attention_mask, past):
        a, self_kv = self.self_attn(self.ln1(x), past_key_value=past)
        x = x + a
        x = x + self.encoder_attn(self.ln2(x), key_value_states=encoder_hidden_states,
                                  attention_mask=encoder_attention_mask)[0]
        return x + self.mlp(self.ln3(x)), self_kv


class MoonshineForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.encoder = MoonshineEncoder(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(64, config.hidden_size)
        self.layers = nn.ModuleList([MoonshineDecoderLayer(config) for _ in range(config.decoder_num_hidden_layers)])
        self.proj_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @torch.no_grad()
    def generate(self, input_values, attention_mask=None, max_new_tokens=6):
        encoder_hidden_states, encoder_attention_mask = self.encoder(input_values, attention_mask)
        b = input_values.shape[0]
        tokens = torch.full((b, 1), self.config.decoder_start_token_id, dtype=torch.long)
        cache = [None] * len(self.layers)
        all_logits = []
        for step in range(max_new_tokens):
            x = self.embed_tokens(tokens[:, -1:]) + self.embed_positions(torch.tensor([step]))
            for i, layer in enumerate(self.layers):
                x, cache[i] = layer(x, encoder_hidden_states, encoder_attention_mask, cache[i])
            logits = self.proj_out(x[:, -1])
            all_logits.append(logits)
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=-1)
        return tokens, torch.stack(all_logits, 1)


model = MoonshineForConditionalGeneration(MoonshineConfig()).eval()
long_clip = torch.randn(28800) * 0.3
short_clip = torch.randn(9600) * 0.3
# processor pads the batch with zeros and returns attention_mask over raw samples
input_values = torch.zeros(2, 28800)
input_values[0], input_values[1, :9600] = long_clip, short_clip
attention_mask = torch.zeros(2, 28800, dtype=torch.long)
attention_mask[0], attention_mask[1, :9600] = 1, 1

tokens, logits = model.generate(input_values, attention_mask=attention_mask)
_, solo_logits = model.generate(short_clip[None], attention_mask=torch.ones(1, 9600, dtype=torch.long))
diff = (logits[1] - solo_logits[0]).abs().max().item()
print("batched tokens:", tokens.tolist())
print(f"fixed={FIXED} short clip, batched vs alone: max logit diff {diff:.3e}")
