# Citation: krasserm/perceiver-io perceiver/model/core/modules.py @018a8bc7f7d1cef1079b9792d663d8e3c43cf0e5
# The encoder's latents cross-attend the padded token sequence; pad_mask (True = pad token) is repeated to
# "(b h) () j" and filled with -finfo.max before softmax. Latent self-attention and the decoder's output-query
# cross-attention over latents take no mask (latents are never padded). Text classification on a right-padded batch.
import torch
import torch.nn as nn

torch.manual_seed(0)


class MultiHeadAttention(nn.Module):
    def __init__(self, num_heads, num_q_input_channels, num_kv_input_channels, num_qk_channels=None,
                 num_v_channels=None, num_output_channels=None, dropout=0.0):
        super().__init__()
        if num_qk_channels is None:
            num_qk_channels = num_q_input_channels
        if num_v_channels is None:
            num_v_channels = num_qk_channels
        if num_output_channels is None:
            num_output_channels = num_q_input_channels
        num_qk_channels_per_head = num_qk_channels // num_heads
        self.dp_scale = num_qk_channels_per_head ** -0.5
        self.num_heads = num_heads
        self.q_proj = nn.Linear(num_q_input_channels, num_qk_channels)
        self.k_proj = nn.Linear(num_kv_input_channels, num_qk_channels)
        self.v_proj = nn.Linear(num_kv_input_channels, num_v_channels)
        self.o_proj = nn.Linear(num_v_channels, num_output_channels)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x_q, x_kv, pad_mask=None, attn_mask=None):
        if attn_mask is not None:
            raise NotImplementedError("attention masks not supported yet")
        q = self.q_proj(x_q)
        k = self.k_proj(x_kv)
        v = self.v_proj(x_kv)
        # einops rearrange "b n (h c) -> (b h) n c"
        q, k, v = (x.view(x.shape[0], x.shape[1], self.num_heads, -1).transpose(1, 2).flatten(0, 1) for x in [q, k, v])
        attn = torch.einsum("b i c, b j c -> b i j", q, k) * self.dp_scale
        if pad_mask is not None:
            # einops repeat "b j -> (b h) () j"
            pad_mask = pad_mask.repeat_interleave(self.num_heads, dim=0)[:, None, :]
            attn_max_neg = -torch.finfo(attn.dtype).max
            attn.masked_fill_(pad_mask, attn_max_neg)
        attn = attn.softmax(dim=-1)
        attn = self.dropout(attn)
        o = torch.einsum("b i j, b j c -> b i c", attn, v)
        # einops rearrange "(b h) n c -> b n (h c)"
        o = o.view(-1, self.num_heads, o.shape[1], o.shape[2]).transpose(1, 2).flatten(2)
        return self.o_proj(o)


class CrossAttention(nn.Module):
    def __init__(self, num_heads, num_q_input_channels, num_kv_input_channels):
        super().__init__()
        self.q_norm = nn.LayerNorm(num_q_input_channels)
        self.kv_norm = nn.LayerNorm(num_kv_input_channels)
        self.attention = MultiHeadAttention(num_heads, num_q_input_channels, num_kv_input_channels)

    def forward(self, x_q, x_kv, pad_mask=None, attn_mask=None):
        return self.attention(self.q_norm(x_q), self.kv_norm(x_kv), pad_mask=pad_mask, attn_mask=attn_mask)


class SelfAttention(nn.Module):
    def __init__(self, num_heads, num_channels):
        super().__init__()
        self.norm = nn.LayerNorm(num_channels)
        self.attention = MultiHeadAttention(num_heads, num_channels, num_channels)

    def forward(self, x, pad_mask=None, attn_mask=None):
        x = self.norm(x)
        return self.attention(x, x, pad_mask=pad_mask, attn_mask=attn_mask)


class MLP(nn.Sequential):
    def __init__(self, num_channels, widening_factor):
        super().__init__(nn.LayerNorm(num_channels), nn.Linear(num_channels, widening_factor * num_channels),
                         nn.GELU(), nn.Linear(widening_factor * num_channels, num_channels))


class CrossAttentionLayer(nn.Module):
    def __init__(self, num_heads, num_q_input_channels, num_kv_input_channels, widening_factor=1):
        super().__init__()
        self.cross_attn = CrossAttention(num_heads, num_q_input_channels, num_kv_input_channels)
        self.mlp = MLP(num_q_input_channels, widening_factor)

    def forward(self, x_q, x_kv, pad_mask=None):
        x = self.cross_attn(x_q, x_kv, pad_mask=pad_mask) + x_q  # Residual
        return self.mlp(x) + x


class SelfAttentionLayer(nn.Module):
    def __init__(self, num_heads, num_channels, widening_factor=1):
        super().__init__()
        self.self_attn = SelfAttention(num_heads, num_channels)
        self.mlp = MLP(num_channels, widening_factor)

    def forward(self, x):
        x = self.self_attn(x) + x
        return self.mlp(x) + x


class TextInputAdapter(nn.Module):
    def __init__(self, vocab_size, max_seq_len, num_input_channels):
        super().__init__()
        self.num_input_channels = num_input_channels
        self.txt_embedding = nn.Embedding(vocab_size, num_input_channels)
        self.pos_encoding = nn.Parameter(torch.empty(max_seq_len, num_input_channels))
        with torch.no_grad():
            self.pos_encoding.uniform_(-0.5, 0.5)

    def forward(self, x):
        b, l = x.shape
        return self.txt_embedding(x) + self.pos_encoding[:l]


class PerceiverEncoder(nn.Module):
    def __init__(self, input_adapter, num_latents, num_latent_channels, num_self_attention_layers_per_block=2):
        super().__init__()
        self.input_adapter = input_adapter
        self.cross_attn = CrossAttentionLayer(4, num_latent_channels, input_adapter.num_input_channels)
        self.self_attn = nn.ModuleList([SelfAttentionLayer(4, num_latent_channels)
                                        for _ in range(num_self_attention_layers_per_block)])
        self.latent = nn.Parameter(torch.empty(num_latents, num_latent_channels).normal_(0.0, 0.02))

    def forward(self, x, pad_mask=None):
        b, *_ = x.shape
        x = self.input_adapter(x)
        x_latent = self.latent.expand(b, -1, -1)  # repeat "... -> b ..."
        x_latent = self.cross_attn(x_latent, x, pad_mask=pad_mask)
        for layer in self.self_attn:
            x_latent = layer(x_latent)
        return x_latent


class PerceiverDecoder(nn.Module):
    def __init__(self, num_classes, num_latent_channels, num_output_query_channels=32):
        super().__init__()
        self._output_query = nn.Parameter(torch.empty(1, num_output_query_channels).normal_(0.0, 0.02))
        self.cross_attn = CrossAttentionLayer(1, num_output_query_channels, num_latent_channels)
        self.linear = nn.Linear(num_output_query_channels, num_classes)

    def forward(self, x):
        output_query = self._output_query.expand(x.shape[0], -1, -1)  # repeat "... -> b ..."
        output = self.cross_attn(output_query, x)
        return self.linear(output).squeeze(dim=1)


class TextClassifier(nn.Module):
    def __init__(self, pad_token_id=0):
        super().__init__()
        self.pad_token_id = pad_token_id
        self.encoder = PerceiverEncoder(TextInputAdapter(50, 16, 32), num_latents=8, num_latent_channels=32)
        self.decoder = PerceiverDecoder(num_classes=3, num_latent_channels=32)

    def forward(self, x, pad_mask=None):
        return self.decoder(self.encoder(x, pad_mask=pad_mask))


model = TextClassifier()
lengths = [10, 6, 3]
x = torch.zeros(3, 10, dtype=torch.long)
for i, n in enumerate(lengths):
    x[i, :n] = torch.randint(1, 50, (n,))
pad_mask = x == model.pad_token_id  # collator: True marks padding
y = torch.tensor([0, 2, 1])
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
model.train()
for step in range(3):
    logits = model(x, pad_mask=pad_mask)
    loss = nn.functional.cross_entropy(logits, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")
model.eval()
with torch.no_grad():
    batched = model(x, pad_mask=pad_mask)
    for i, n in enumerate(lengths):
        single = model(x[i:i + 1, :n], pad_mask=pad_mask[i:i + 1, :n])
        assert torch.allclose(batched[i], single[0], atol=1e-5), i
print("padded batch matches unpadded rows")
