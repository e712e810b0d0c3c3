# fixie-ai/ultravox#146: Ultravox batches audios of different lengths through its ModifiedWhisperEncoder padded to
# the longest one, but the encoder layers were called without an attention mask, so real frames attend to padding.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

N_MELS, D_MODEL, HEADS, LAYERS, MAX_POS, STACK, LLM_DIM = 8, 32, 4, 2, 64, 2, 48


class WhisperSdpaAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = D_MODEL // HEADS
        self.q_proj = nn.Linear(D_MODEL, D_MODEL)
        self.k_proj = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.v_proj = nn.Linear(D_MODEL, D_MODEL)
        self.out_proj = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, hidden_states, attention_mask=None):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, HEADS, -1).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, t, HEADS, -1).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, t, HEADS, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=False)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, D_MODEL))


class WhisperEncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = WhisperSdpaAttention()
        self.self_attn_layer_norm = nn.LayerNorm(D_MODEL)
        self.final_layer_norm = nn.LayerNorm(D_MODEL)
        self.fc1, self.fc2 = nn.Linear(D_MODEL, 4 * D_MODEL), nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, hidden_states, attention_mask, layer_head_mask=None):
        hidden_states = hidden_states + self.self_attn(self.self_attn_layer_norm(hidden_states), attention_mask)
        residual = hidden_states
        hidden_states = self.fc2(F.gelu(self.fc1(self.final_layer_norm(hidden_states))))
        return (residual + hidden_states,)


class ModifiedWhisperEncoder(nn.Module):
    """Whisper encoder that accepts variable-length audio (no padding to 30 s)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(N_MELS, D_MODEL, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(D_MODEL, D_MODEL, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(MAX_POS, D_MODEL)
        self.layers = nn.ModuleList([WhisperEncoderLayer() for _ in range(LAYERS)])
        self.layer_norm = nn.LayerNorm(D_MODEL)

    def _get_feat_extract_output_lengths(self, input_lengths):
        return (input_lengths - 1) // 2 + 1

    def get_extended_attention_mask(self, attention_mask, dtype):
        extended = attention_mask[:, None, None, :].to(dtype)
        return (1.0 - extended) * torch.finfo(dtype).min

    def forward(self, input_features, audio_len=None):
        hidden_states = F.gelu(self.conv1(input_features))
        hidden_states = F.gelu(self.conv2(hidden_states)).permute(0, 2, 1)
        hidden_states = hidden_states + self.embed_positions.weight[: hidden_states.shape[1]]

        attention_mask = None
        if FIXED and audio_len is not None:
            audio_feature_len = self._get_feat_extract_output_lengths(audio_len)
            max_seq_len = hidden_states.shape[1]
            attention_mask = torch.arange(max_seq_len)[None, :].lt(audio_feature_len.view(-1, 1))
            attention_mask = self.get_extended_attention_mask(attention_mask, hidden_states.dtype)

        for encoder_layer in self.layers:
            layer_outputs = encoder_layer(hidden_states, attention_mask, layer_head_mask=None)
            hidden_states = layer_outputs[0]
        return self.layer_norm(hidden_states)


class UltravoxProjector(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_1 = nn.Linear(D_MODEL * STACK, LLM_DIM)
        self.linear_2 = nn.Linear(LLM_DIM, LLM_DIM)

    def forward(self, audio_features):
        b, t, c = audio_features.shape
        audio_features = F.pad(audio_features, (0, 0, 0, (-t) % STACK)).reshape(b, -1, c * STACK)
        return self.linear_2(F.silu(self.linear_1(audio_features)))


class UltravoxModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.audio_tower = ModifiedWhisperEncoder()
        self.multi_modal_projector = UltravoxProjector()

    def encode_audio(self, audio_values, audio_lens):
        audio_tower_output = self.audio_tower(audio_values, audio_len=audio_lens)
        return self.multi_modal_projector(audio_tower_output)


@torch.no_grad()
def main():
    model = UltravoxModel().eval()
    lens = torch.tensor([16, 40])  # mel frames of two clips in one batch
    clips = [torch.randn(N_MELS, int(n)) for n in lens]
    audio_values = torch.stack([F.pad(c, (0, int(lens.max()) - c.shape[1])) for c in clips])

    batched = model.encode_audio(audio_values, lens)
    alone = model.encode_audio(clips[0][None], lens[:1])
    n_tok = alone.shape[1] - 1  # last audio token straddles the conv boundary; compare the rest
    diff = (batched[0, :n_tok] - alone[0, :n_tok]).abs().max().item()
    print(f"fixed={FIXED} short clip audio embeddings, batched vs alone: max diff {diff:.3e}")


if __name__ == "__main__":
    main()
