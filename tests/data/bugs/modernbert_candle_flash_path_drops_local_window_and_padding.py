# vllm-project/semantic-router#3406: ModernBertAttention's flash path received pad_mask and the local
# window but called flash_attn(q, k, v, scale, causal=False) with neither, so local layers attended globally.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ModernBertConfig:
    vocab_size = 64
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 3
    global_attn_every_n_layers = 3
    local_attention = 4  # +-2 tokens on local layers
    use_flash_attn = True


def flash_attn(q, k, v, softmax_scale, causal):
    # candle_flash_attn::flash_attn: no window, no key padding
    return F.scaled_dot_product_attention(q, k, v, scale=softmax_scale, is_causal=causal)


def flash_attn_windowed(q, k, v, softmax_scale, pad_mask, window_left, window_right):
    L = q.shape[-2]
    pos = torch.arange(L)
    rel = pos[None, :] - pos[:, None]
    allowed = (rel >= -window_left) & (rel <= window_right)
    allowed = allowed[None, None] & pad_mask[:, None, None, :].bool()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=softmax_scale)


class ModernBertAttention(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.use_flash = config.use_flash_attn
        if layer_id % config.global_attn_every_n_layers != 0:
            self.window = config.local_attention // 2
        else:
            self.window = None

    def forward(self, hidden, pad_mask):
        b, L, d = hidden.shape
        qkv = self.Wqkv(hidden).view(b, L, 3, self.n_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        scale = self.head_dim ** -0.5
        if self.use_flash:
            if FIXED:
                w = self.window if self.window is not None else L
                out = flash_attn_windowed(q, k, v, scale, pad_mask, w, w)
            else:
                out = flash_attn(q, k, v, scale, False)
        else:
            pos = torch.arange(L)
            allowed = pad_mask[:, None, None, :].bool()
            if self.window is not None:
                allowed = allowed & ((pos[None, :] - pos[:, None]).abs() <= self.window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        return self.Wo(out.transpose(1, 2).reshape(b, L, d))


class ModernBertLayer(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.hidden_size)
        self.attn = ModernBertAttention(config, layer_id)
        self.mlp = nn.Sequential(nn.LayerNorm(config.hidden_size), nn.Linear(config.hidden_size, 64),
                                 nn.GELU(), nn.Linear(64, config.hidden_size))

    def forward(self, h, pad_mask):
        h = h + self.attn(self.attn_norm(h), pad_mask)
        return h + self.mlp(h)


class ModernBertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([ModernBertLayer(config, i) for i in range(config.num_hidden_layers)])
        self.final_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, input_ids, pad_mask):
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, pad_mask)
        return self.final_norm(h)


def tokenize_batch(texts, pad_id=0):
    # PaddingStrategy::BatchLongest, right padding
    L = max(len(t) for t in texts)
    ids = torch.tensor([t + [pad_id] * (L - len(t)) for t in texts])
    mask = torch.tensor([[1] * len(t) + [0] * (L - len(t)) for t in texts])
    return ids, mask


config = ModernBertConfig()
model = ModernBertModel(config).eval()
texts = [list(range(1, 13)), list(range(5, 12))]
ids, pad_mask = tokenize_batch(texts)

with torch.no_grad():
    out = model(ids, pad_mask)
    for layer in model.layers:  # dense path as the reference
        layer.attn.use_flash = False
    ref = model(ids, pad_mask)

diff = (out - ref)[pad_mask.bool()].abs().max().item()
print(f"fixed={FIXED} max |flash path - dense path| on real tokens: {diff:.3e}")
