# huggingface/transformers#26428 (fixed by huggingface/transformers#26839): in IDEFICS the text tokens that come
# before any <image> have an image_attention_mask row that masks every image token; the fully masked row still
# softmaxes to a uniform average over the image, so those tokens read the image. The fix gates them to zero.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

HIDDEN, HEADS, VIS = 32, 4, 24


class IdeficsAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, kv_input_dim):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(kv_input_dim, hidden_size, bias=False)
        self.v_proj = nn.Linear(kv_input_dim, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, key_value_states, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        kv_len = key_value_states.shape[1]
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(key_value_states).view(bsz, kv_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(key_value_states).view(bsz, kv_len, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class IdeficsGatedCrossAttentionLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.cross_attn = IdeficsAttention(HIDDEN, HEADS, VIS)
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.alpha_cross_attn = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, hidden_states, image_hidden_states, image_attention_mask, cross_attention_gate=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.cross_attn(hidden_states, image_hidden_states, image_attention_mask)
        if cross_attention_gate is not None:
            # Fill in zeros for cross_attention hidden_states of tokens attending to no images
            hidden_states[cross_attention_gate == 0] = hidden_states[cross_attention_gate == 0].fill_(0)
        return residual + torch.tanh(self.alpha_cross_attn) * hidden_states


class IdeficsDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.o = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, L, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(h.transpose(1, 2).reshape(B, L, HIDDEN))


class IdeficsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(50, HIDDEN)
        self.layers = nn.ModuleList(IdeficsDecoderLayer() for _ in range(2))
        self.gated_cross_attn_layers = nn.ModuleList(IdeficsGatedCrossAttentionLayer() for _ in range(2))

    def invert_attention_mask(self, mask):
        return (1.0 - mask[:, None].float()) * torch.finfo(torch.float32).min

    def forward(self, input_ids, image_hidden_states, image_attention_mask):
        batch_size, text_seq_len = input_ids.shape
        num_images, image_seq_len = image_hidden_states.shape[1], image_hidden_states.shape[2]
        image_hidden_states = image_hidden_states.view(batch_size, num_images * image_seq_len, VIS)
        image_attention_mask = image_attention_mask.unsqueeze(-1).repeat(1, 1, 1, image_seq_len)
        image_attention_mask = image_attention_mask.view(batch_size, text_seq_len, num_images * image_seq_len)
        image_attention_mask = self.invert_attention_mask(image_attention_mask)
        cross_attention_gate = None
        if FIXED:
            cross_attention_gate = ((image_attention_mask == 0.0).any(dim=-1)).float().squeeze(dim=1)
        hidden_states = self.embed_tokens(input_ids)
        for layer, xlayer in zip(self.layers, self.gated_cross_attn_layers):
            hidden_states = xlayer(hidden_states, image_hidden_states, image_attention_mask, cross_attention_gate)
            hidden_states = layer(hidden_states)
        return hidden_states


def main():
    model = IdeficsModel().eval()
    # "User: what is this" <fake> <image> <fake> "a cat" : the image is at position 5
    input_ids = torch.tensor([[1, 7, 8, 9, 10, 32, 33, 32, 11, 12]])
    image_pos = 5
    # processor output: a token attends to the image once the image has appeared
    image_attention_mask = torch.zeros(1, input_ids.shape[1], 1, dtype=torch.long)
    image_attention_mask[:, image_pos:, 0] = 1
    images_a = torch.randn(1, 1, 6, VIS)
    images_b = torch.randn(1, 1, 6, VIS)
    with torch.no_grad():
        ha = model(input_ids, images_a, image_attention_mask)
        hb = model(input_ids, images_b, image_attention_mask)
    d = (ha[:, :image_pos] - hb[:, :image_pos]).abs().max().item()
    print(f"{'fixed' if FIXED else 'buggy'}: text before the image changes with the image by {d:.4e}")


if __name__ == "__main__":
    main()
